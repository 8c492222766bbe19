"""The evaluation tools end to end on the CPU: perplexity and TPOT on tiny random models, perplexity on SmolLM2."""

from __future__ import annotations

import json
import math

import pytest
from conftest import smollm2_gguf, wikitext_path

from evals import kernel_profile, perplexity, tpot

TEXT = wikitext_path()


@pytest.fixture
def text_file(tmp_path):
    if TEXT is not None:
        return str(TEXT)
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    return str(path)


def test_perplexity_tiny_random_model(tmp_path, text_file, capsys):
    out = tmp_path / "ppl.json"
    args = ["--random-config", "tiny-llama", "--max-tokens", "3000", "--ctx", "256", "--stride", "128"]
    # the CPU runs of the tools (the reference backend), on any machine
    code = perplexity.main([*args, "--text-file", text_file, "--json", str(out), "--device", "cpu"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["tool"] == "evals.perplexity" and result["model"] == "tiny-llama"
    assert {"torch", "transformers", "device", "command"} <= result["environment"].keys()
    settings = {"ctx": 256, "stride": 128, "max_tokens": 3000, "backend": "auto", "modes": ["unpatched", "patched"]}
    assert result["settings"] == settings
    base, patched = result["results"]["unpatched"], result["results"]["patched"]
    # random weights over a 512-token vocabulary (text read as bytes): perplexity of the order of the vocabulary
    # size (above it: tiny-llama's raised init makes its random logits confidently wrong)
    assert 512 / 5 < base["perplexity"] < 512 * 10
    # HF's recipe: every window scores its new tokens minus one (the label shift), as counted by the guide
    windows = len(list(perplexity.windows(3000, ctx=256, stride=128)))
    assert base["tokens_scored"] == patched["tokens_scored"] == 3000 - windows
    assert abs(patched["delta_ppl_relative"]) < 1e-6  # reference backend on the CPU: the same arithmetic
    assert patched["first_window_top1_agreement"] == 1.0
    assert result["unpatch_restores_baseline"] is True
    assert "unpatched" in capsys.readouterr().out


def test_perplexity_one_mode(tmp_path, text_file, capsys):
    """--modes patched evaluates the patched model alone, to the same perplexity as in a run of both (the reference
    backend on the CPU: the same arithmetic), with no comparison; a mode it does not know is refused."""
    args = ["--random-config", "tiny-llama", "--max-tokens", "1000", "--ctx", "256", "--stride", "128"]
    args += ["--text-file", text_file, "--device", "cpu"]
    both, one = tmp_path / "both.json", tmp_path / "one.json"
    assert perplexity.main([*args, "--json", str(both)]) == 0
    assert perplexity.main([*args, "--json", str(one), "--modes", "patched"]) == 0
    full, single = json.loads(both.read_text()), json.loads(one.read_text())
    assert list(single["results"]) == ["patched"] and single["settings"]["modes"] == ["patched"]
    assert single["results"]["patched"]["perplexity"] == full["results"]["patched"]["perplexity"]
    assert "delta_ppl" not in single["results"]["patched"] and single["unpatch_restores_baseline"] is None
    assert single["patch_report"] is not None
    with pytest.raises(SystemExit):
        perplexity.main([*args, "--modes", "patched,fast"])
    assert "--modes takes unpatched, patched or both" in capsys.readouterr().err


def test_sliding_windows_score_every_token_once():
    spans = list(perplexity.windows(1000, ctx=256, stride=100))
    assert spans[0] == (0, 256, 256)
    assert sum(scored for _, _, scored in spans) == 1000
    assert spans[-1][1] == 1000
    assert all(end - begin <= 256 for begin, end, _ in spans)


def test_tpot_tiny_model_with_sweep_plot(tmp_path, capsys):
    out = tmp_path / "tpot.json"
    args = ["--random-config", "tiny-pythia", "--new-tokens", "8", "--repeats", "2", "--sweep-context", "16,32"]
    code = tpot.main([*args, "--json", str(out), "--device", "cpu"])
    assert code == 0
    result = json.loads(out.read_text())
    modes = {r["mode"] for r in result["results"]}
    assert modes == {"hf-eager", "patched-eager", "patched"}
    assert {r["context"] for r in result["results"]} == {16, 32}
    for row in result["results"]:
        assert row["tpot_ms"] > 0 and math.isfinite(row["tpot_ms"]) and len(row["tpot_ms_all"]) == 2
        assert row["bytes_per_step"] > result["weight_bytes"] > 0
    assert (tmp_path / "tpot.png").stat().st_size > 10_000
    assert "TPOT ms" in capsys.readouterr().out
    assert result["complete"] is True


def test_prefill_column_times_one_forward_keeping_the_last_logits(monkeypatch):
    """evals.tpot's prefill column (CUDA only; timed here by a stand-in): one forward over the whole prompt, the
    logits of its last position alone, as generate's prefill computes them, without a cache."""
    import torch

    from patcher import random_models as rm

    model = rm.build("tiny-llama", dtype=torch.float32, device="cpu")
    prompt = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    outputs = []

    def timed(fn, reps, warmup):
        outputs.append(fn())
        return 1.5

    monkeypatch.setattr(tpot.common, "gpu_time_ms", timed)
    assert tpot.prefill_ms(model, prompt) == 1.5
    (out,) = outputs
    assert out.logits.shape == (2, 1, model.config.vocab_size)
    assert not {"past_key_values", "cache"} & set(out.keys())  # no cache built
    with torch.inference_mode():  # (one row through lm_head, not nine: fp32 rounding apart)
        torch.testing.assert_close(out.logits[:, 0], model(prompt).logits[:, -1])


def test_tpot_batch_sweep_with_plot(tmp_path, capsys):
    """--sweep-batch: every mode at each batch size, rows marked with it, the plot against the batch."""
    out = tmp_path / "tpot.json"
    args = ["--random-config", "tiny-llama", "--new-tokens", "8", "--repeats", "1", "--prompt-len", "16"]
    code = tpot.main([*args, "--modes", "patched", "--sweep-batch", "1,3", "--json", str(out), "--device", "cpu"])
    assert code == 0
    result = json.loads(out.read_text())
    assert sorted((r["mode"], r["batch"], r["context"]) for r in result["results"]) == [
        ("patched", 1, 16),
        ("patched", 3, 16),
    ]
    one, three = sorted(result["results"], key=lambda r: r["batch"])
    assert three["bytes_per_step"] > one["bytes_per_step"]  # three rows of KV cache read per step
    assert three["tokens_per_s"] == pytest.approx(3 / (three["tpot_ms"] / 1e3))
    assert (tmp_path / "tpot.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "batch" in printed.splitlines()[0]
    with pytest.raises(SystemExit):
        tpot.main([*args, "--sweep-batch", "1,2", "--sweep-context", "16,32", "--device", "cpu"])
    with pytest.raises(SystemExit):
        tpot.main([*args, "--sweep-batch", "0,2", "--device", "cpu"])


def test_tpot_keeps_the_other_modes_when_one_fails(tmp_path, monkeypatch, capsys):
    """A mode that raises (a compile error, out of memory) is reported with its error; the other modes are still
    measured, the JSON holds them all (it is rewritten after every mode), and the exit code says something failed."""
    measure = tpot.measure_mode
    written = []
    write_json = tpot.common.write_json

    def failing(model, mode, *args, **kwargs):
        if mode == "patched-eager":
            raise RuntimeError("injected failure")
        return measure(model, mode, *args, **kwargs)

    def recording_write_json(path, payload, announce=True):
        written.append([r["mode"] for r in payload["results"]])
        write_json(path, payload, announce)

    monkeypatch.setattr(tpot, "measure_mode", failing)
    monkeypatch.setattr(tpot.common, "write_json", recording_write_json)
    out = tmp_path / "tpot.json"
    args = ["--random-config", "tiny-llama", "--new-tokens", "4", "--repeats", "1", "--no-profile"]
    code = tpot.main([*args, "--json", str(out), "--device", "cpu"])
    assert code == 1
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["patched-eager"]["error"] == "RuntimeError: injected failure" and "tpot_ms" not in rows["patched-eager"]
    assert rows["hf-eager"]["tpot_ms"] > 0 and rows["patched"]["tpot_ms"] > 0
    assert written[:3] == [["hf-eager"], ["hf-eager", "patched-eager"], ["hf-eager", "patched-eager", "patched"]]
    assert "patched-eager at context 128, batch 1 failed: RuntimeError: injected failure" in capsys.readouterr().out


def test_tpot_rejects_compiled_modes_on_cpu():
    with pytest.raises(SystemExit):
        tpot.main(["--random-config", "tiny-llama", "--modes", "hf-static-compiled", "--device", "cpu"])


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None or TEXT is None, reason="needs the SmolLM2 GGUF and WikiText")
def test_perplexity_smollm2_on_a_wikitext_slice(tmp_path):
    out = tmp_path / "ppl.json"
    args = ["--gguf-file", str(smollm2_gguf()), "--text-file", str(TEXT), "--max-tokens", "512", "--ctx", "256"]
    code = perplexity.main([*args, "--stride", "128", "--json", str(out), "--device", "cpu"])
    assert code == 0
    result = json.loads(out.read_text())
    base, patched = result["results"]["unpatched"], result["results"]["patched"]
    assert 5 < base["perplexity"] < 100  # a trained model on WikiText
    assert abs(patched["delta_ppl_relative"]) < 1e-5
    assert result["text_tokens"] == 304986  # the WikiText-2 test split as HF's recipe tokenizes it


@pytest.mark.parametrize(
    "raw, short",
    [
        (
            "void patcher::(anonymous namespace)::gemv_kernel<__half, 8, 1, 2, 0, 4, 1>(patcher::GemvParams)",
            "gemv_kernel<__half, 8, 1, 2, 0, 4, 1>",
        ),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float> >(at::native::ReduceOp<float>)",
            "at::native::reduce_kernel<512, 1, at::native::ReduceOp<float> >",
        ),
        (
            "ampere_fp16_s16816gemm_fp16_128x64_ldg8_f2f_stages_64x4_tn",
            "ampere_fp16_s16816gemm_fp16_128x64_ldg8_f2f_stages_64x4_tn",
        ),
    ],
)
def test_kernel_names_in_the_step_profile(raw, short):
    assert kernel_profile.short_kernel_name(raw) == short
    assert len(kernel_profile.short_kernel_name("k" * 300)) == 100


def test_kernel_shares_add_up_to_the_time_a_kernel_ran():
    # A chain under programmatic dependent launch: each kernel starts before the previous one ends; then a gap with
    # no kernel, and a kernel that runs entirely inside another one's span.
    spans = [
        ("a", 0.0, 10.0),
        ("b", 4.0, 15.0),  # adds 10 .. 15
        ("a", 12.0, 20.0),  # adds 15 .. 20
        ("c", 30.0, 33.0),  # after a gap of 10; `inside` ends first, so c adds 30 .. 31 and 32 .. 33
        ("inside", 31.0, 32.0),  # adds 31 .. 32
    ]
    shares = kernel_profile.kernel_shares(spans)
    assert shares["a"] == [2, 18.0, 15.0]
    assert shares["b"] == [1, 11.0, 5.0]
    assert shares["inside"] == [1, 1.0, 1.0]
    assert shares["c"] == [1, 3.0, 2.0]
    assert sum(s[2] for s in shares.values()) == 23.0  # 0 .. 20 and 30 .. 33
    # A long run over two shorter ones with a gap between them: it adds the gap and its ends, not the others' time.
    shares = kernel_profile.kernel_shares([("x", 0.0, 1.0), ("y", 5.0, 6.0), ("long", 0.5, 10.0)])
    assert shares["long"] == [1, 9.5, 8.0]


def test_kernel_runs_by_their_place_in_a_layer():
    # Two prefill runs of "k", then two layers of two "k" runs each (with "attn" between): the prefill runs keep the
    # name, the rest take their place in the layer, and a kernel not in `places` is left alone.
    spans = [("k", float(i), i + 0.5) for i in range(2)] + [
        ("k", 10.0, 11.0),
        ("attn", 11.0, 12.0),
        ("k", 12.0, 13.0),
        ("k", 20.0, 21.0),
        ("attn", 21.0, 22.0),
        ("k", 22.0, 23.0),
    ]
    names = [name for name, _, _ in kernel_profile.by_place(spans, {"k": 2}, {"k": 2})]
    assert names == ["k", "k", "k #1", "attn", "k #2", "k #1", "attn", "k #2"]
    assert kernel_profile.short_place_name("void patcher::f<int>(int) #2") == "f<int> #2"
    assert kernel_profile.short_place_name("void patcher::f<int>(int)") == "f<int>"


def test_prefill_shares_rank_kernels_and_split_them_by_place():
    # Two layers, each a dequantization and a GEMM for each of two projections, then the attention, and one head
    # GEMM after them: the layer's two places of each repeated kernel come apart, the head's GEMM counts with them.
    spans, t = [], 0.0
    for _ in range(2):
        for name, us in (("dequant", 1.0), ("gemm", 10.0), ("dequant", 2.0), ("gemm", 20.0), ("attn", 5.0)):
            spans.append((name, t, t + us))
            t += us
    spans.append(("head", t, t + 3.0))
    profile = kernel_profile.prefill_shares(spans, layers=2)
    assert profile["prefill_kernels"] == 11 and profile["prefill_critical_us"] == t + 3.0
    assert [r["kernel"] for r in profile["prefill_top_kernels"]] == ["gemm", "attn", "dequant", "head"]
    assert profile["prefill_top_kernels"][0]["critical_us"] == 60.0
    places = {r["kernel"]: r["critical_us"] for r in profile["prefill_kernel_places"]}
    assert places == {"gemm #2": 40.0, "gemm #1": 20.0, "dequant #2": 4.0, "dequant #1": 2.0}
    assert profile["prefill_span_us"] == t + 3.0 and profile["prefill_idle"] == []


def test_kernel_tables_print_the_step_and_the_prefill():
    spans = [
        ("void patcher::gemm<int>(int)", 0.0, 10.0),
        ("norm", 12.0, 13.0),
        ("void patcher::gemm<int>(int)", 13.0, 20.0),
    ]
    row = {"context": 2048, "prefill_ms": 0.021, **kernel_profile.prefill_shares(spans, layers=1)}
    text = "\n".join(kernel_profile.kernel_tables(row, "patched"))
    assert "prefill of 2048 tokens (0.0 ms timed)" in text and "ran 18 us of the 20 us" in text
    assert "gemm<int> #2" in text  # two a layer: by place
    assert "idle GPU time" in text and "gemm<int>" in text.split("idle GPU time")[1]
    assert "per step" not in text  # no decode step profiled in this row
    step = {"top_kernels": [], "critical_us_per_step": 5.0, "tpot_ms": 0.01, "gpu_busy": 0.5, "kernel_us_per_step": 6}
    assert kernel_profile.kernel_tables(step, "patched") == []  # an empty profile prints nothing
    assert kernel_profile.kernel_tables({}, "patched") == []


def test_idle_gaps_by_the_kernels_around_them():
    # a idles 2 us before b twice; c runs inside b's span (no gap after it); 1 us idle between b and d.
    spans = [("a", 0.0, 1.0), ("b", 3.0, 10.0), ("c", 4.0, 5.0), ("d", 11.0, 12.0), ("a", 12.0, 13.0)]
    spans += [("b", 15.0, 16.0)]
    gaps = kernel_profile.idle_gaps(spans)
    assert [(g["after"], g["before"], g["gaps"], g["idle_us"]) for g in gaps] == [
        ("a", "b", 2, 4.0),
        ("b", "d", 1, 1.0),
    ]


def test_splits_tool_on_a_tiny_int4_model(tmp_path, capsys, monkeypatch):
    """evals.splits times the split rule and each configuration with a fresh runner per round (CPU, reference
    backend: the timings mean nothing here, the bookkeeping does), and records the K slices each one ran and the
    runner options it set."""
    from evals import splits
    from patcher.decode import DecodeOptions, DecodeRunner

    out = tmp_path / "splits.json"
    args = ["--random-config", "tiny-llama", "--int4-random", "32", "--device", "cpu", "--prompt-len", "8"]
    args += ["--new-tokens", "3", "--rounds", "2", "--repeats", "1", "--json", str(out)]
    configs = ["qkv=2,out=3", "mlp_out=4", "defer_qkv=0", "out=3,defer_int4=0,int4_separate_norm_batch=2"]
    created = []
    original_init = DecodeRunner.__init__

    def recording_init(self, model, options=None):
        created.append(options)
        original_init(self, model, options)

    monkeypatch.setattr(DecodeRunner, "__init__", recording_init)
    assert splits.main([*args, "--configs", *configs]) == 0
    result = json.loads(out.read_text())
    assert result["tool"] == "evals.splits" and result["model"] == "tiny-llama-int4-g32"
    rows = {row["config"]: row for row in result["results"]}
    assert list(rows) == ["rule", *configs]
    rule = rows["rule"]["splits"]
    assert rule.keys() == {"qkv", "out", "mlp_in", "mlp_out"}
    assert rows["qkv=2,out=3"]["splits"] == {**rule, "qkv": 2, "out": 3}
    assert rows["mlp_out=4"]["splits"] == {**rule, "mlp_out": 4}
    assert rows["defer_qkv=0"]["splits"] == rule and rows["defer_qkv=0"]["options"] == {"defer_qkv": False}
    both = rows[configs[3]]
    assert both["splits"] == {**rule, "out": 3}
    assert both["options"] == {"defer_int4": False, "int4_separate_norm_batch": 2}
    assert created[:5] == [DecodeOptions()] + [  # each runner built with its configuration, round after round
        DecodeOptions(int4_splits=splits.parse_config(c)[0], **splits.parse_config(c)[1]) for c in configs
    ]
    for row in rows.values():
        assert len(row["tpot_ms_rounds"]) == len(row["diff_ms_rounds"]) == 2 and row["tpot_ms"] > 0
        assert row["tokens_match_rule"] is True  # the CPU reference computes every linear whole
    assert rows["rule"]["diff_ms_rounds"] == [0.0, 0.0]
    assert "qkv=2,out=3" in capsys.readouterr().out
    bad_configs = (
        ("qkv=x", "role=slices pairs"),
        ("qkv_mlp=2", "no int4 linear of role 'qkv_mlp'"),
        ("defer_qkv=2", "defer_qkv takes 0 or 1"),
        ("int4_separate_norm_batch=0", "takes a whole number >= 1"),
    )
    for bad, message in bad_configs:
        with pytest.raises(SystemExit):
            splits.main([*args, "--configs", bad])
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("w4a16", [False, True])
def test_tpot_on_random_gguf_blocks(tmp_path, w4a16):
    """--gguf-random TYPE: every decoder linear a GGUFLinear of random blocks; the JSON names the type and the
    activation mode, and the step's bytes count the blocks (not the dense weights they replaced)."""
    out = tmp_path / "tpot.json"
    args = ["--random-config", "tiny-llama", "--gguf-random", "Q4_0", "--new-tokens", "4", "--repeats", "1"]
    args += ["--modes", "hf-eager", "--device", "cpu", "--no-profile", "--json", str(out)]
    assert tpot.main([*args, *(["--w4a16"] if w4a16 else [])]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == f"tiny-llama-q4_0-{'w4a16' if w4a16 else 'w4a8'}"
    tpot.main(["--random-config", "tiny-llama", "--new-tokens", "4", "--repeats", "1", "--modes", "hf-eager",
               "--device", "cpu", "--no-profile", "--json", str(tmp_path / "dense.json")])  # fmt: skip
    dense_bytes = json.loads((tmp_path / "dense.json").read_text())["weight_bytes"]
    assert 0 < result["weight_bytes"] < dense_bytes  # 4.5 bits a weight in the decoder linears instead of 32


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--random-config", "tiny-llama", "--keep-quantized"], "--keep-quantized needs --gguf-file"),
        (["--random-config", "tiny-llama", "--w4a16"], "--w4a16 needs"),
        (["--random-config", "tiny-llama", "--gguf-random", "Q3_X"], "not supported"),
        (["--random-config", "tiny-llama", "--gguf-random", "Q4_K"], "not a multiple"),  # tiny rows < 256
        (["--random-config", "tiny-llama", "--gguf-random", "Q4_0", "--int4-random", "32"], "--gguf-random goes"),
    ],
)
def test_gguf_arguments_are_checked(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tpot.main([*args, "--device", "cpu", "--modes", "hf-eager", "--no-profile"])
    assert message in str(exit_info.value)


@pytest.mark.gpu
def test_ops_gguf_cases_time_the_products_they_name():
    """evals.ops' GGUF rows (the decode GEMV per type and projection, the prefill linear): each timed call and its
    dense counterpart compute the same product, up to what quantizing the activations to Q8_1 changes (about 1% of
    the output's size, against 100% for a wrong weight or layout)."""
    import torch

    from evals.decode_op_cases import DECODE_CASES
    from evals.op_cases import case_gguf_linear
    from patcher.ops import KERNELS, build

    build.load()
    builder, _, variants = DECODE_CASES["gguf"]
    cases = [builder(2, "qwen2-1.5b", torch.float16, KERNELS, v) for v in variants]
    cases.append(tuple([f] for f in case_gguf_linear(64, "qwen2-1.5b", torch.float16, KERNELS)[:2]) + (0,))
    for (fused, unfused, _), what in zip(cases, [*variants, "gguf_linear"]):
        got, expected = fused[0]().float(), unfused[0]().float()
        assert got.shape == expected.shape, what
        assert (got - expected).norm() <= 0.05 * expected.norm(), what
