"""A request and its status: the one owner of per-request state.

Status changes only through :meth:`Request.transition`, which consults ``_TRANSITIONS``::

    WAITING  -> RUNNING                      admitted by the scheduler
    WAITING  -> FINISHED_ABORTED             aborted before (re-)admission
    RUNNING  -> WAITING                      preempted by recompute (blocks dropped)
    RUNNING  -> FINISHED_STOPPED             EOS, a stop token or a stop string
    RUNNING  -> FINISHED_LENGTH              max_tokens or max_model_len reached
    RUNNING  -> FINISHED_ABORTED             aborted by the caller, or preempted too often (``error`` says so)

Any other change raises ``RuntimeError``: it is a bug, not bad input. One exception, by its own method:
:meth:`Request.restate_stop_string` turns a request that EOS, a stop token or its length ended into one a stop
string ended, when that string ended the text earlier in the same step. Pure Python, no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's name for a terminal status: "stop", "length" or "abort"; None while unfinished."""
        return _FINISH_REASON.get(self)


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED}),
    RequestStatus.RUNNING: frozenset(
        {
            RequestStatus.WAITING,
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        }
    ),
    RequestStatus.FINISHED_STOPPED: frozenset(),
    RequestStatus.FINISHED_LENGTH: frozenset(),
    RequestStatus.FINISHED_ABORTED: frozenset(),
}


@dataclass
class Request:
    """All the state of one request. Other modules read it and change it only through its methods, each field
    group with one writer: the status, the tokens and their accounting, the error and the timestamps are the
    scheduler's (``core/scheduler.py``); the block fields the KV-cache manager's; the output side (detokenized
    text, logprobs, the grammar's progress) the engine's, through the methods at the end.

    Token accounting (``num_tokens = len(prompt) + len(output)``)::

        | prompt_token_ids ............ | output_token_ids ...... |
        |<---- num_computed_tokens ---->|  (KV written for these)
                                        |<- new this step ->|
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float = 0.0
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # written only by the KV-cache manager
    num_reserved_blocks: int = 0  # worst-case admission: blocks held beyond block_ids
    # Prefix caching (written only by the KV-cache manager): the chained hash of each full block of
    # all_token_ids so far, how many blocks of block_ids are in the cache's map, and the prompt tokens the
    # first admission found cached (OpenAI's usage.prompt_tokens_details.cached_tokens).
    cache_salt: str | None = None  # requests with different salts never share blocks
    lora_id: int = 0  # its LoRA adapter's id (0: the base model); set at creation
    lora_key: str | None = (
        None  # the adapter's weights digest: requests of different adapters never share blocks
    )
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # prompt/output tokens computed again after a preemption
    num_returned_tokens: int = 0  # tokens already handed to the caller (never handed twice)
    first_scheduled_time_s: float | None = None  # first admission into the batch (end of its queueing)
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None
    finished_time_s: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # set when the engine, not the caller, aborted it
    error_kind: str | None = None  # with error: one of tokenmill.errors.ERROR_KINDS
    # The output side: the text so far (the engine's), logprobs per output token (appended with each token).
    output_text: str = ""
    output_logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    embedding: list[float] | None = None  # an embedding model's pooled output
    detokenizer: Any = None
    # Constrained decoding (tokenmill.structured_outputs): the llguidance matcher, and how many output tokens
    # it has consumed (the engine advances it; the sampler reads its mask).
    grammar: Any = None
    num_grammar_tokens: int = 0
    # Speculative decoding (the scheduler's): verification steps with a proposal, tokens proposed, accepted.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")

    # --- status -------------------------------------------------------------------------------
    def transition(self, new_status: RequestStatus) -> None:
        if new_status not in _TRANSITIONS[self.status]:
            raise RuntimeError(
                f"request {self.request_id!r}: illegal transition {self.status.name} -> {new_status.name}"
            )
        self.status = new_status

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        if self.error is not None and self.status is RequestStatus.FINISHED_ABORTED:
            return "error"
        return self.status.finish_reason

    # --- tokens -------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most tokens this request may generate: its worst case."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV is not yet in the cache (the whole sequence again after a preemption)."""
        return self.num_tokens - self.num_computed_tokens

    # --- written by the scheduler --------------------------------------------------------------
    def set_num_computed(self, num_tokens: int) -> None:
        """At admission: the cached prefix counts as computed (0 again when the request does not fit)."""
        self.num_computed_tokens = num_tokens

    def record_cache_hit(self) -> None:
        """The first admission's cached prefix is what usage reports as cached (a re-admission's is not)."""
        if self.num_preemptions == 0:
            self.num_cached_tokens = self.num_computed_tokens

    def mark_scheduled(self, now_s: float | None) -> None:
        """Admitted into the batch: the first admission ends its time in the queue (a re-admission does not)."""
        if self.first_scheduled_time_s is None and now_s is not None:
            self.first_scheduled_time_s = now_s

    def add_recomputed(self, num_tokens: int) -> None:
        """A row computed ``num_tokens`` tokens again whose KV a preemption had dropped."""
        self.num_recomputed_tokens += num_tokens

    def advance(self, num_tokens: int) -> None:
        """A forward wrote the K/V of ``num_tokens`` more tokens."""
        self.num_computed_tokens += num_tokens

    def drop_computed(self) -> None:
        """Preempted by recompute: nothing of it stays computed."""
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def set_error(self, kind: str, message: str) -> None:
        """The engine, not the caller, ends it: ``kind`` is one of tokenmill.errors.ERROR_KINDS."""
        self.error, self.error_kind = message, kind

    def finish(self, status: RequestStatus, stop_reason: int | str | None, now_s: float | None) -> None:
        self.transition(status)  # RuntimeError when it is already finished: ending twice is a bug
        self.stop_reason = stop_reason
        self.finished_time_s = now_s if now_s is not None else self.last_token_time_s

    def restate_stop_string(self, stop_string: str, num_output_tokens: int) -> None:
        """A request the scheduler ended on a step's later token (EOS, a stop id, max_tokens) whose text a stop
        string ended earlier in that step (speculative decoding appends several tokens): it ends there instead,
        stopped by the string, with only the tokens up to it. Its blocks are already back; only the record changes."""
        if self.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            raise RuntimeError(
                f"request {self.request_id!r}: a stop string restated while {self.status.name}"
            )
        self.truncate_output(num_output_tokens)
        self.status = RequestStatus.FINISHED_STOPPED
        self.stop_reason = stop_string

    def stamp_finished(self, now_s: float) -> None:
        """For a request ended where no clock was at hand (``schedule()``): the time it is reported."""
        if self.finished_time_s is None:
            self.finished_time_s = now_s

    def append_output_token(self, token_id: int, now_s: float, logprobs: Any = None) -> None:
        """A sampled token, with its logprob entry when the request asked for logprobs."""
        if self.status is not RequestStatus.RUNNING:
            raise RuntimeError(f"request {self.request_id!r}: token appended while {self.status.name}")
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        if self.first_token_time_s is None:
            self.first_token_time_s = now_s
        self.last_token_time_s = now_s

    def record_speculation(self, num_proposed: int, num_accepted: int) -> None:
        """One verification: ``num_proposed`` draft tokens, of which the first ``num_accepted`` were kept."""
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_proposed
        self.num_spec_accepted_tokens += num_accepted

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep the first ``num_output_tokens`` outputs: a stop string ended the text inside a step's tokens
        (speculative decoding appends several), and what follows it was never generated as far as anyone sees."""
        if num_output_tokens >= len(self.output_token_ids):
            return
        del self.output_token_ids[num_output_tokens:]
        del self.output_logprobs[num_output_tokens:]
        self.num_returned_tokens = min(self.num_returned_tokens, num_output_tokens)
        self.num_grammar_tokens = min(self.num_grammar_tokens, num_output_tokens)

    # --- written by the KV-cache manager ----------------------------------------------------------
    def set_block_table(self, block_ids: list[int], num_cached_blocks: int = 0) -> None:
        """A table of blocks (a cached prefix at admission, or none when the request lets go of them)."""
        self.block_ids = list(block_ids)
        self.num_cached_blocks = num_cached_blocks

    def append_blocks(self, block_ids: list[int], num_reserved_blocks: int) -> None:
        """New blocks at the end of the table, and the worst-case reservation still held beyond it."""
        self.block_ids.extend(block_ids)
        self.num_reserved_blocks = num_reserved_blocks

    def drop_leading_blocks(self, num_blocks: int, marker: int) -> None:
        """The first ``num_blocks`` entries given back (outside a sliding window): ``marker`` keeps their places."""
        self.block_ids[:num_blocks] = [marker] * num_blocks

    def drop_trailing_blocks(self, num_keep: int, num_reserved_blocks: int) -> None:
        """Entries from ``num_keep`` on given back (rejected draft tokens' slots); the reservation after it."""
        del self.block_ids[num_keep:]
        self.num_reserved_blocks = num_reserved_blocks

    def release_blocks(self) -> None:
        self.block_ids, self.num_reserved_blocks, self.num_cached_blocks = [], 0, 0

    def mark_blocks_cached(self, num_blocks: int) -> None:
        """The first ``num_blocks`` full blocks are in the prefix cache's map."""
        self.num_cached_blocks = num_blocks

    def add_block_hash(self, block_hash: bytes) -> None:
        self.block_hashes.append(block_hash)

    # --- written by the engine's output side -----------------------------------------------------
    def take_new_token_ids(self) -> list[int]:
        """Output tokens not yet handed to the caller; marks them handed."""
        new = self.output_token_ids[self.num_returned_tokens :]
        self.num_returned_tokens = len(self.output_token_ids)
        return new

    def take_grammar_token_ids(self) -> list[int]:
        """Output tokens the grammar's matcher has not consumed yet; marks them consumed."""
        new = self.output_token_ids[self.num_grammar_tokens :]
        self.num_grammar_tokens = len(self.output_token_ids)
        return new

    def set_embedding(self, vector: list[float]) -> None:
        """An embedding model's pooled output for this prompt (the model runner's, once)."""
        self.embedding = vector

    def add_prompt_logprobs(self, entries: list[Any]) -> None:
        self.prompt_logprobs = (self.prompt_logprobs or []) + list(entries)

    def set_output_text(self, text: str) -> None:
        self.output_text = text
