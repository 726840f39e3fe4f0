"""The offline API in the shape vLLM users know: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.config import OFFLINE_BATCHED_TOKENS, SPECULATION_AUTO, EngineConfig
from tokenmill.engine import Engine, ParamsArg, Prompt, Prompts, as_prompt_list
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import RequestOutput

Message = dict[str, Any]


class LLM:
    """An engine plus conveniences. Keyword arguments are ``EngineConfig`` fields.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        unknown = set(engine_kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        engine_kwargs.setdefault(
            "max_num_batched_tokens", OFFLINE_BATCHED_TOKENS
        )  # offline: throughput first
        engine_kwargs.setdefault("speculative_config", SPECULATION_AUTO)  # n-gram lookup for thin batches
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompts,
        sampling_params: ParamsArg = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt (strings or lists of token ids), in order. ``lora_request``: a LoRA
        adapter for every prompt, or one (or None) per prompt (``LLM(..., enable_lora=True)``)."""
        prompt_list = as_prompt_list(prompts)
        return self.engine.generate(
            prompt_list,
            sampling_params,
            use_tqdm=use_tqdm and len(prompt_list) > 1,
            lora_request=lora_request,
        )

    def embed(self, prompts: Prompts) -> list[list[float]]:
        """An embedding model's vector per prompt (strings or lists of token ids), in order."""
        return self.engine.embed(as_prompt_list(prompts))

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: ParamsArg = None,
        use_tqdm: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.
        ``chat_template_kwargs``: more variables for the template (``{"enable_thinking": False}`` for Qwen3)."""
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts: list[Prompt] = []
        for conversation in conversations:
            prompts.append(
                self.engine.tokenizer.encode_chat(list(conversation), template_kwargs=chat_template_kwargs)  # type: ignore[arg-type]
            )
        outputs = self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        return outputs
