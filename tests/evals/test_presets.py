"""evals.tpot --generate-args: the presets, the offline tokenizer they use on random-weight models, and a tiny CPU
run of the presets end to end."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers.generation.stopping_criteria import StopStringCriteria

from evals import presets, tpot

ALL = list(presets.PRESETS)


@pytest.fixture(scope="module")
def tokenizer():
    return presets.offline_tokenizer(512)


def test_presets_parse_in_order_once():
    assert presets.parse("sampling, greedy,sampling") == ["sampling", "greedy"]
    assert presets.parse(",".join(ALL)) == ALL
    for bad in ("greedy,beam-search", "", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="choose from greedy"):
            presets.parse(bad)


def test_unknown_preset_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tpot.main(["--random-config", "tiny-llama", "--device", "cpu", "--generate-args", "greedy,beam"])
    assert exit_info.value.code == 2
    assert "argument --generate-args: unknown preset(s) 'beam'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tpot.main(["--random-config", "tiny-llama", "--device", "cpu", "--profile", "--no-profile"])


def test_each_preset_builds_its_arguments(tokenizer):
    setup = presets.Setup(vocab_size=512, tokenizer=tokenizer, batch=1)
    built = {name: presets.arguments(name, setup, 17) for name in ALL}
    assert built["greedy"] == {"do_sample": False}
    assert built["sampling"] == {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
    qwen = built["qwen-instruct"]
    assert (qwen["temperature"], qwen["top_p"], qwen["top_k"], qwen["repetition_penalty"]) == (0.7, 0.8, 20, 1.1)
    assert qwen["eos_token_id"] == [510, 511]
    llama = built["llama-instruct"]
    assert (llama["temperature"], llama["top_p"], llama["eos_token_id"]) == (0.6, 0.9, [509, 510, 511])
    assert "top_k" not in llama  # the model's generation config has none: transformers' default applies
    assert built["min-new-tokens"]["min_new_tokens"] == 17 and built["min-new-tokens"]["eos_token_id"] == [510, 511]
    assert built["stop-strings"]["tokenizer"] is tokenizer
    assert built["stop-strings"]["stop_strings"] == list(presets.OFFLINE_STOP_STRINGS)
    assert isinstance(built["streamer"]["streamer"], presets.QuietTextStreamer)
    setup.batch = 3
    assert len(presets.arguments("streamer", setup, 17)["streamer"].rows) == 3
    assert presets.describe(built["streamer"]) == {"do_sample": False, "streamer": "QuietTextStreamer"}
    assert presets.describe(llama)["eos_token_id"] == [509, 510, 511]
    assert presets.Setup(vocab_size=512, offline=False).stop_strings == list(presets.STOP_STRINGS)


def test_offline_tokenizer_has_the_model_vocabulary():
    big = presets.offline_tokenizer(151936)  # Qwen2's vocabulary: built from a dict, well under a second
    assert len(big) == len(big.get_vocab()) == 151936
    assert big.decode([0, 151935]) == " t0 t151935"
    ids = torch.randint(0, 151936, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    assert big(big.decode(ids), add_special_tokens=False)["input_ids"] == ids


def test_offline_tokenizer_with_stop_strings(tokenizer):
    ids = torch.tensor([[1, 2, 7, 9], [1, 7, 9, 8], [3, 79, 4, 5]])
    assert StopStringCriteria(tokenizer, [" t7 t9"])(ids, None).tolist() == [True, False, False]
    assert StopStringCriteria(tokenizer, ["t8"])(ids, None).tolist() == [False, True, False]
    never = StopStringCriteria(tokenizer, list(presets.OFFLINE_STOP_STRINGS))
    many = torch.randint(0, 512, (64, 200), generator=torch.Generator().manual_seed(0))
    assert not any(s in tokenizer.decode(row) for row in many.tolist() for s in presets.OFFLINE_STOP_STRINGS)
    for end in range(1, 200):
        assert not never(many[:, :end], None).any()


def test_streamers_decode_every_token(tokenizer):
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    steps = torch.tensor([[11, 12], [13, 14], [15, 16]])  # [step, row]
    one = presets.QuietTextStreamer(tokenizer)
    one.put(prompt[:1])
    for step in steps:
        one.put(step[:1])
    one.end()
    assert one.chars == len(tokenizer.decode(steps[:, 0].tolist())) == len(" t11 t13 t15")
    rows = presets.RowStreamers(tokenizer, 2)
    rows.put(prompt)
    for step in steps:
        rows.put(step)
    rows.end()
    assert [r.chars for r in rows.rows] == [len(tokenizer.decode(steps[:, i].tolist())) for i in range(2)]


def test_ratios_to_greedy_and_to_hf_static():
    def row(mode, preset, tpot_ms, batch=1):
        return {"mode": mode, "preset": preset, "tpot_ms": tpot_ms, "batch": batch, "context": 128}

    rows = [
        row("hf-static-compiled", "greedy", 4.0),
        row("hf-static-compiled", "streamer", 8.0),
        row("patched", "greedy", 2.0),
        row("patched", "streamer", 3.0),
        row("patched", "sampling", 2.5),
        row("patched", "streamer", 6.0, batch=8),  # no greedy or hf-static row at batch 8
        {"mode": "patched", "preset": "greedy", "error": "failed", "batch": 8, "context": 128},
    ]
    presets.add_ratios(rows)
    assert [r.get("x_greedy") for r in rows] == [1.0, 2.0, 1.0, 1.5, 1.25, None, None]
    assert [r.get("x_hf_static") for r in rows] == [None, None, 0.5, 0.375, None, None, None]


def test_warning_where_a_preset_left_the_graph_path():
    row = {"mode": "patched", "preset": "streamer", "context": 128, "batch": 32, "decode_path": "hf"}
    assert tpot.off_graph({**row, "decode_reason": "batch 32"}) == (
        "warning: patched streamer at context 128, batch 32 ran on the hf path: batch 32"
    )
    assert tpot.off_graph({**row, "decode_path": "graph"}) is None
    assert tpot.off_graph({**row, "mode": "patched-eager"}) is None  # HF's loop by design there


def test_tpot_presets_on_a_tiny_model(tmp_path, capsys):
    """Each (mode, batch, preset) is a row with its arguments and x_greedy; at batch 2 the streamer preset streams
    each row (HF's loop feeds it [2] tensors)."""
    out = tmp_path / "tpot.json"
    args = ["--random-config", "tiny-qwen2", "--device", "cpu", "--new-tokens", "3", "--repeats", "1"]
    args += ["--prompt-len", "8", "--modes", "hf-eager,patched", "--sweep-batch", "1,2", "--no-profile"]
    chosen = ["greedy", "streamer", "stop-strings", "min-new-tokens", "sampling"]
    assert tpot.main([*args, "--json", str(out), "--generate-args", ",".join(chosen)]) == 0
    result = json.loads(out.read_text())
    rows = result["results"]
    setup = presets.Setup(512, tokenizer=presets.offline_tokenizer(512))
    expected = [(b, m, p) for b in (1, 2) for m in ("hf-eager", "patched") for p in chosen]
    assert [(r["batch"], r["mode"], r["preset"]) for r in rows] == expected
    for row in rows:
        assert row["tpot_ms"] > 0 and row["x_greedy"] > 0 and "error" not in row
        setup.batch = row["batch"]
        assert row["arguments"] == presets.describe(presets.arguments(row["preset"], setup, 4))
    assert {r["x_greedy"] for r in rows if r["preset"] == "greedy"} == {1.0}
    assert rows[6]["x_greedy"] == rows[6]["tpot_ms"] / rows[5]["tpot_ms"]  # patched streamer / patched greedy
    assert rows[11]["arguments"]["streamer"] == "RowStreamers"
    patched = [r for r in rows if r["mode"] == "patched"]
    assert all(r["decode_path"] in ("graph", "eager-runner", "hf") and "decode_reason" in r for r in patched)
    assert rows[3]["arguments"]["min_new_tokens"] == 4 and rows[3]["rows_stopped_early"] == 0
    assert (tmp_path / "tpot.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "x greedy" in printed.splitlines()[0] and "stop-strings" in printed


def test_static_cache_preset_sizes_the_cache_once(tmp_path, monkeypatch):
    """static-cache asks every mode for HF's static cache at the run's one size (max_cache_len), so that HF compiles
    once; a patched model on the CPU leaves it to HF's loop."""
    from transformers import GenerationMixin

    sizes = []
    original = GenerationMixin.generate

    def generate(self, *args, **kwargs):
        sizes.append((kwargs.get("cache_implementation"), kwargs.get("max_cache_len")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    out = tmp_path / "tpot.json"
    args = ["--random-config", "tiny-llama", "--device", "cpu", "--new-tokens", "3", "--repeats", "1", "--prompt-len"]
    args += ["8", "--modes", "hf-eager,patched", "--no-profile", "--generate-args", "greedy,static-cache"]
    assert tpot.main([*args, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["preset"]) for r in rows] == [
        (m, p) for m in ("hf-eager", "patched") for p in ("greedy", "static-cache")
    ]
    assert all("error" not in r and r["tpot_ms"] > 0 for r in rows)
    assert rows[3]["decode_path"] == "hf"
    static = {size for implementation, size in sizes if implementation == "static"}
    assert static == {8 + 3 + 1}  # the prompt, the new tokens and one more: every call the same size


def test_tpot_reports_a_preset_whose_output_stopped_early(tmp_path, monkeypatch, capsys):
    """A call that made fewer tokens than asked (every row at an EOS id) is an error row, not a timing."""
    monkeypatch.setitem(
        presets.PRESETS, "greedy", lambda setup, n: {"do_sample": False, "eos_token_id": list(range(setup.vocab_size))}
    )
    out = tmp_path / "tpot.json"
    args = ["--random-config", "tiny-qwen2", "--device", "cpu", "--new-tokens", "3", "--repeats", "1"]
    args += ["--prompt-len", "8", "--modes", "hf-eager", "--generate-args", "greedy", "--json", str(out)]
    assert tpot.main(args) == 1
    (row,) = json.loads(out.read_text())["results"]
    assert row["preset"] == "greedy" and "tpot_ms" not in row
    assert row["error"].startswith("RuntimeError: generation stopped early") and "(4, 1)" in row["error"]
    assert "hf-eager greedy at context 8, batch 1 failed" in capsys.readouterr().out
