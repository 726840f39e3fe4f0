"""LoRA adapters against peft: tiny random Llama and Qwen2 models built by transformers, adapters made by peft with
random A and B (several ranks, rsLoRA, all projections or a few), saved as PEFT folders and served by tokenmill.
The reference is peft's own ``merge_and_unload()`` model: every prompt position's and every generated token's
log-probability within 1e-3 of it, greedy tokens equal; one batch mixing base rows and three adapters gives each row
what it gets alone; the same prompt under two adapters never shares cached blocks; every bad input a ValueError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_model_families import (  # noqa: E402,F401
    build_hf,
    embedded_tokenizer_fields,
    prompts,
    save_dir,
    tokenizer_files,
)

from tokenmill import LoRARequest, SamplingParams  # noqa: E402
from tokenmill.engine import Engine  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATOL = 1e-3


def make_adapter(hf_model, out: Path, seed: int, rank: int, targets: list[str], rslora: bool = False) -> Path:
    """A peft LoRA on ``hf_model`` (a deep copy is wrapped) with random A and B, saved to ``out``."""
    import copy

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank + 3, target_modules=targets, use_rslora=rslora)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # lora_B starts at zero: both random, so the adapter changes the outputs
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out)
    return out


def merged(hf_model, adapter_dir: Path):
    import copy

    return peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), str(adapter_dir)).merge_and_unload().eval()


@torch.inference_mode()
def reference_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """log-softmax at every position of one sequence, [T, vocab]."""
    return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].double(), dim=-1)


def assert_matches(output, reference_model, prompt: list[int]) -> None:
    """Prompt logprobs (prefill) and each generated token (greedy, teacher-forced logprobs) against the model."""
    out_ids = list(output.outputs[0].token_ids)
    ref = reference_logprobs(reference_model, prompt + out_ids)
    for pos in range(1, len(prompt)):
        got = output.prompt_logprobs[pos].logprob
        assert abs(got - float(ref[pos - 1, prompt[pos]])) < ATOL, ("prompt", pos)
    for i, (token, lp) in enumerate(zip(out_ids, output.outputs[0].logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert token == int(row.argmax()), ("greedy token", i)
        assert abs(lp.logprob - float(row[token])) < ATOL, ("output", i)


PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def family_setup(request, tokenizer_files, tmp_path_factory):  # noqa: F811
    family = request.param
    hf_model = build_hf(family)
    root = tmp_path_factory.mktemp(f"lora-{family}")
    base = save_dir(hf_model, tokenizer_files, root / "base")
    adapters = {
        "all-r8": make_adapter(hf_model, root / "all-r8", seed=1, rank=8, targets=ALL),
        "qv-r4": make_adapter(hf_model, root / "qv-r4", seed=2, rank=4, targets=["q_proj", "v_proj"]),
        "mlp-r16-rs": make_adapter(
            hf_model,
            root / "mlp-r16-rs",
            seed=3,
            rank=16,
            targets=["gate_proj", "up_proj", "down_proj"],
            rslora=True,
        ),
    }
    return family, hf_model, base, adapters


def lora(adapters: dict[str, Path], name: str) -> LoRARequest:
    return LoRARequest(name, list(adapters).index(name) + 1, str(adapters[name]))


@pytest.mark.parametrize(
    "family_setup", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)], indirect=True
)
def test_each_adapter_matches_peft_merged_and_a_mixed_batch_matches_alone(family_setup) -> None:
    family, hf_model, base, adapters = family_setup
    engine = Engine(model=str(base), device="cpu", enable_lora=True, max_loras=3, max_lora_rank=16,
                    num_kv_blocks=256, speculative_config=None)  # fmt: skip
    batch = prompts([23, 40, 17, 33], seed=7)
    alone = {}
    for name in adapters:
        reference = merged(hf_model, adapters[name])
        (out,) = engine.generate([batch[0]], PARAMS, lora_request=lora(adapters, name))
        assert_matches(out, reference, batch[0])
        alone[name] = out.outputs[0].token_ids
    (base_out,) = engine.generate([batch[0]], PARAMS)
    assert_matches(base_out, hf_model, batch[0])
    assert len({tuple(t) for t in [*alone.values(), base_out.outputs[0].token_ids]}) == 4  # visibly different
    # one batch: base, then the three adapters, each prompt once per adapter (prompts differ by row)
    rows = [(p, None) for p in batch] + [(p, lora(adapters, n)) for n in adapters for p in batch]
    outs = engine.generate([p for p, _ in rows], PARAMS, lora_request=[r for _, r in rows])
    for (prompt, request), out in zip(rows, outs, strict=True):
        reference = hf_model if request is None else merged(hf_model, adapters[request.lora_name])
        assert_matches(out, reference, prompt)
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.parametrize("family_setup", ["llama"], indirect=True)
def test_prefix_cache_keeps_adapters_apart_and_one_slot_serves_them_in_turn(family_setup) -> None:
    _, hf_model, base, adapters = family_setup
    engine = Engine(model=str(base), device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16,
                    num_kv_blocks=256, block_size=16, speculative_config=None)  # fmt: skip
    prompt = prompts([70], seed=3)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = engine.generate([prompt], params, lora_request=lora(adapters, "all-r8"))[0]
    again = engine.generate([prompt], params, lora_request=lora(adapters, "all-r8"))[0]
    other = engine.generate([prompt], params, lora_request=lora(adapters, "qv-r4"))[0]
    plain = engine.generate([prompt], params)[0]
    assert (
        first.metrics.num_cached_tokens == 0 and again.metrics.num_cached_tokens == 64
    )  # 4 full blocks of the 70 tokens
    assert other.metrics.num_cached_tokens == 0 and plain.metrics.num_cached_tokens == 0
    # one slot, three adapters and the base model at once: every request ends, each as it does alone
    names = list(adapters)
    reqs = [lora(adapters, n) for n in names] + [None]
    outs = engine.generate([prompt] * 4, params, lora_request=reqs)
    for request, out in zip(reqs, outs, strict=True):
        alone = engine.generate([prompt], params, lora_request=request)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.scheduler.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("family_setup", ["llama"], indirect=True)
def test_adapters_under_speculation_and_preemption(family_setup) -> None:
    """Speculation with the base model as the draft (the verification rows take each row's adapter, the draft
    none) and a pool small enough to preempt (a re-prefill keeps its adapter): the same greedy tokens as a plain
    roomy engine."""
    _, _, base, adapters = family_setup
    batch = prompts([32, 27, 40, 30], seed=5)
    reqs = [lora(adapters, "all-r8"), lora(adapters, "qv-r4"), None, lora(adapters, "mlp-r16-rs")]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = Engine(model=str(base), device="cpu", enable_lora=True, max_loras=3, num_kv_blocks=256,
                   speculative_config=None)  # fmt: skip
    expected = [o.outputs[0].token_ids for o in plain.generate(batch, params, lora_request=reqs)]
    tight = Engine(model=str(base), device="cpu", enable_lora=True, max_loras=3, num_kv_blocks=14, block_size=8,
                   speculative_config={"method": "draft_model", "model": str(base), "num_speculative_tokens": 3,
                                       "draft_p_min": 0.0, "disable_by_batch_size": 0})  # fmt: skip
    outs = tight.generate(batch, params, lora_request=reqs)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tight.stats.num_preemptions > 0 and tight.stats.num_spec_drafts > 0
    assert tight.num_free_blocks == tight.num_total_blocks


@pytest.mark.parametrize("family_setup", ["qwen2"], indirect=True)
def test_bad_adapters_are_value_errors(family_setup, tmp_path: Path) -> None:
    family, hf_model, base, adapters = family_setup
    engine = Engine(model=str(base), device="cpu", enable_lora=True, max_lora_rank=8, num_kv_blocks=64,
                    speculative_config=None)  # fmt: skip
    prompt = prompts([5])[0]
    with pytest.raises(ValueError, match="rank 16 is above max_lora_rank 8"):
        engine.add_request(prompt, lora_request=lora(adapters, "mlp-r16-rs"))
    other = build_hf(family, hidden_size=96, intermediate_size=160)  # another base model's shapes
    wrong = make_adapter(other, tmp_path / "wrong", seed=4, rank=4, targets=["q_proj"])
    with pytest.raises(ValueError, match="another base model"):
        engine.add_lora(LoRARequest("wrong", 9, str(wrong)))
    head = make_adapter(hf_model, tmp_path / "head", seed=5, rank=4, targets=["lm_head"])
    with pytest.raises(ValueError, match="lm_head"):
        engine.add_lora(LoRARequest("head", 10, str(head)))
    with pytest.raises(ValueError, match="adapter_config.json"):
        engine.add_lora(LoRARequest("empty", 11, str(tmp_path)))
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        engine.add_lora(LoRARequest("dora", 12, str(dora)))
    engine.add_lora(lora(adapters, "all-r8"))
    with pytest.raises(ValueError, match="LoRA id 1 is adapter"):
        engine.add_lora(LoRARequest("renamed", 1, str(adapters["qv-r4"])))
    with pytest.raises(ValueError, match="positive integer"):
        LoRARequest("x", 0, "/tmp")
    off = Engine(model=str(base), device="cpu", num_kv_blocks=64, speculative_config=None)
    with pytest.raises(ValueError, match="enable_lora"):
        off.add_request(prompt, lora_request=lora(adapters, "all-r8"))
    assert not engine.has_unfinished() and not off.has_unfinished()


def write_gguf_lora(adapter_dir: Path, path: Path, arch: str, hf_config) -> Path:  # type: ignore[no-untyped-def]
    """A PEFT adapter written as llama.cpp's ``convert_lora_to_gguf.py`` writes one: general.type adapter,
    adapter.type lora, adapter.lora.alpha, ``blk.N.<tensor>.weight.lora_a`` / ``.lora_b`` (A in F16, B in F32),
    q and k's B rows interleaved for a ``llama`` model as the base's rows are."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from test_model_families import _GGUF_LAYER, _llama_cpp_permute

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for key, tensor in sorted(load_file(str(adapter_dir / "adapter_model.safetensors")).items()):
        rest = key.removeprefix("base_model.model.model.layers.")
        layer, module_path = rest.split(".", 1)
        module, which = module_path.rsplit(".", 2)[0], module_path.rsplit(".", 2)[1]
        name = f"blk.{layer}.{_GGUF_LAYER[module + '.weight']}.{'lora_a' if which == 'lora_A' else 'lora_b'}"
        array = tensor.float().numpy()
        if arch == "llama" and which == "lora_B" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = hf_config.num_attention_heads if "q_proj" in module else hf_config.num_key_value_heads
            array = _llama_cpp_permute(array, heads)
        writer.add_tensor(
            name, np.ascontiguousarray(array.astype(np.float16 if which == "lora_A" else np.float32))
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_cpp_gguf_lora_on_a_gguf_base(
    family: str,
    embedded_tokenizer_fields,  # noqa: F811
    tmp_path: Path,
) -> None:
    """llama.cpp's LoRA GGUF on a GGUF base (the llama family's q and k rows interleaved in both files): the same
    answers as peft's merged model, and as the PEFT folder of the same adapter, in one batch with the base."""
    from test_model_families import write_family_gguf

    hf_model = build_hf(family, seed=5)
    adapter_dir = make_adapter(hf_model, tmp_path / "peft", seed=6, rank=8, targets=ALL)
    # A as fp16 values (the GGUF keeps A in F16): the peft reference then holds the same weights
    tensors = peft.utils.load_peft_weights(str(adapter_dir))
    from safetensors.torch import save_file

    save_file({k: (v.half().float() if "lora_A" in k else v) for k, v in tensors.items()},
              str(adapter_dir / "adapter_model.safetensors"))  # fmt: skip
    base = tmp_path / f"{family}.gguf"
    write_family_gguf(hf_model, family, base, embedded_tokenizer_fields, quantize=None)
    lora_file = write_gguf_lora(adapter_dir, tmp_path / "adapter.gguf", family, hf_model.config)
    engine = Engine(model=str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
                    num_kv_blocks=128, speculative_config=None)  # fmt: skip
    prompt = prompts([21], seed=4)[0]
    from_gguf, from_peft, plain = engine.generate(
        [prompt] * 3, PARAMS,
        lora_request=[LoRARequest("g", 1, str(lora_file)), LoRARequest("p", 2, str(adapter_dir)), None],
    )  # fmt: skip
    assert_matches(from_gguf, merged(hf_model, adapter_dir), prompt)
    assert from_gguf.outputs[0].token_ids == from_peft.outputs[0].token_ids
    assert from_gguf.outputs[0].token_ids != plain.outputs[0].token_ids
    other = tmp_path / "other.gguf"
    write_gguf_lora(adapter_dir, other, "qwen3" if family != "qwen3" else "llama", hf_model.config)
    with pytest.raises(ValueError, match="made for a"):
        engine.add_lora(LoRARequest("o", 3, str(other)))


@pytest.mark.slow
def test_tensor_parallel_adapters_equal_one_rank(tokenizer_files, tmp_path: Path) -> None:  # noqa: F811
    """TP=2 cuts each adapter as it cuts the weights (B's rows of q, k, v, gate, up; A's columns of o, down, whose
    delta joins the all-reduce): a batch of base rows and two adapters gives TP=1's tokens and log-probabilities."""
    hf_model = build_hf(
        "llama", num_attention_heads=4, num_key_value_heads=2
    )  # head_dim 24, 2 KV heads to split
    base = save_dir(hf_model, tokenizer_files, tmp_path / "base")
    adapters = {n: make_adapter(hf_model, tmp_path / n, seed=i, rank=4 + 4 * i, targets=ALL)
                for i, n in enumerate(["a", "b"])}  # fmt: skip
    batch = prompts([15, 22, 9], seed=2)
    reqs = [LoRARequest("a", 1, str(adapters["a"])), None, LoRARequest("b", 2, str(adapters["b"]))]
    params = PARAMS
    common = dict(model=str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64,
                  speculative_config=None)  # fmt: skip
    one = Engine(**common).generate(batch, params, lora_request=reqs)
    engine = Engine(**common, tensor_parallel_size=2)
    try:
        two = engine.generate(batch, params, lora_request=reqs)
    finally:
        engine.close()
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(la.logprob - lb.logprob) < 1e-4
    assert_matches(one[0], merged(hf_model, adapters["a"]), batch[0])


@pytest.mark.slow
def test_an_adapter_trained_on_the_embedded_model(hf_embedded, tmp_path: Path) -> None:
    """A rank-8 adapter trained with peft for 150 steps on the 135M (transformers' reading of the embedded GGUF)
    to answer a question its own way: served on the GGUF's exact path and on llama.cpp's arithmetic (the default),
    it gives peft's greedy answer (the trained one, not the base model's), while the base rows of the same batch
    keep the base answer."""
    import copy

    hf, tok = hf_embedded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    target = tok.encode(
        " The capital of France is Lyon, a city of lions.<|im_end|>", add_special_tokens=False
    )
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL))
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    ids = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])
    model.train()
    for _ in range(150):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(tmp_path / "lyon")
    with torch.inference_mode():
        trained = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
        plain = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
    assert "Lyon" in tok.decode(trained) and "Lyon" not in tok.decode(plain)
    lora = LoRARequest("lyon", 1, str(tmp_path / "lyon"))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    for quantization in ("gguf", None):
        engine = Engine(quantization=quantization, enable_lora=True, max_lora_rank=8, num_kv_blocks=64,
                        speculative_config=None)  # fmt: skip
        with_lora, without = engine.generate([prompt, prompt], params, lora_request=[lora, None])
        assert with_lora.outputs[0].token_ids[:8] == trained.tolist()[:8], quantization
        assert "Lyon" in with_lora.outputs[0].text and "Lyon" not in without.outputs[0].text
