"""A patched model keeps the nn.Module contract, against an unpatched twin (layers/guard.py):

- autograd: with gradients recorded the patched modules run HF's forwards (HF's gradients, HF's checkpointing);
  under no_grad, or with nothing requiring grad, the fused forwards run;
- weights changed after patching (load_state_dict with and without assign, optimizer steps, `.data`, casts, device
  moves, tie_weights) are what every path reads, the decode runner included;
- hooks on a layer, a norm or a projection see what HF gives them; LoRA adapters in q/k/v/gate/up are served.

CPU: the reference backend. GPU (marked gpu): the CUDA kernels, and the graph decode path for the runner.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from unittest import mock

import pytest
import torch
from conftest import FP32_LOGIT_ATOL, max_err
from torch import nn

from patcher import patch_model, unpatch_model
from patcher import random_models as rm
from patcher.decode import DecodeOptions, DecodeRunner, Sampling, generate_path
from patcher.decode.reasons import model_reason

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-pythia"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GRAD_RTOL = 1e-5
EAGER = DecodeOptions(use_graphs=False)  # the decode runner without CUDA graphs (the CPU's)
# fp32 logits on CUDA: the kernels' GEMVs and reductions sum in other orders than cuBLAS and PyTorch's CUDA ops
CUDA_FP32_ATOL = 1e-4


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return max_err(got, expected) <= (FP32_LOGIT_ATOL if got.device.type == "cpu" else CUDA_FP32_ATOL)


def twins(name, device="cpu", **kwargs):
    """(unpatched model, patched copy of it): the kernels backend on CUDA, the reference one on the CPU."""
    ref = rm.build(name, device=device, **kwargs)
    model = copy.deepcopy(ref)
    patch_model(model)
    return ref, model


def ids_for(model, batch=2, tokens=9, seed=1):
    return torch.randint(3, 500, (batch, tokens), generator=torch.Generator().manual_seed(seed)).to(model.device)


def logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def layers(model):
    return model.base_model.layers


def attention(layer):
    return getattr(layer, "self_attn", None) or layer.attention


def final_norm(model):
    return getattr(model.base_model, "norm", None) or model.base_model.final_layer_norm


@contextlib.contextmanager
def linear_calls():
    """Counts nn.Linear forwards: a fused forward calls none of the projections (only the lm_head runs)."""
    calls = [0]
    forward = nn.Linear.forward

    def counting(self, x):
        calls[0] += 1
        return forward(self, x)

    with mock.patch.object(nn.Linear, "forward", counting):
        yield calls


def assert_grads_equal(ref, model):
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert q.grad is not None, f"{name}: no gradient on the patched model"
        scale = p.grad.abs().max().item() or 1.0
        assert max_err(q.grad, p.grad) <= GRAD_RTOL * scale, name


# ---- autograd ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [*ARCHS, "tiny-neox-sequential"])
def test_gradients_equal_hf(name, device):
    """Training mode, eval mode with grad on, and frozen parameters with inputs_embeds requiring grad: every
    parameter's gradient (q/k/v/gate/up and Qwen2's q/k/v biases included) equals HF's within 1e-5 relative (fp32);
    under no_grad, and in eval mode with nothing requiring grad, the fused forwards run."""
    ref, model = twins(name, device)
    ids = ids_for(ref)
    for m in (ref, model):
        m.train()
        m(ids, labels=ids).loss.backward()
    assert_grads_equal(ref, model)
    for m in (ref, model):
        m.eval().zero_grad(set_to_none=True)
        m(ids).logits.float().pow(2).mean().backward()
    assert_grads_equal(ref, model)

    embeds = []
    for m in (ref, model):
        m.requires_grad_(False)
        e = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        m(inputs_embeds=e).logits.float().pow(2).mean().backward()
        embeds.append(e.grad)
    assert max_err(embeds[1], embeds[0]) <= GRAD_RTOL * embeds[0].abs().max().item()

    expected = logits(ref, ids)
    with linear_calls() as calls:  # nothing requires grad: the fused forwards, grad mode on or off
        out = model(ids).logits
        model.requires_grad_(True)
        logits(model, ids)
    assert calls[0] == 2  # the lm_head twice, no projection
    assert not out.requires_grad and close(out, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", ARCHS)
def test_gradient_checkpointing_as_on_hf(name, reentrant, device, monkeypatch):
    """gradient_checkpointing_enable() checkpoints every layer of the patched model, as on HF's: the same number of
    torch.utils.checkpoint calls and of attention forwards (recomputed in backward), and HF's gradients."""
    from transformers import modeling_utils

    checkpoints = [0]
    checkpoint = modeling_utils.checkpoint

    def counting(*args, **kwargs):
        checkpoints[0] += 1
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(modeling_utils, "checkpoint", counting)
    ref, model = twins(name, device)
    ids = ids_for(ref)
    counts = []
    for m in (ref, model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
        forwards = []
        for layer in layers(m):
            attention(layer).register_forward_pre_hook(lambda *_, seen=forwards: seen.append(1))
        checkpoints[0] = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m(ids, labels=ids).loss.backward()
        counts.append((checkpoints[0], len(forwards)))
    n = ref.config.num_hidden_layers
    assert counts[0] == (n, 2 * n) and counts[1] == counts[0]
    assert_grads_equal(ref, model)


@pytest.mark.parametrize("name", ARCHS)
def test_training_mode_applies_dropout_as_hf(name):
    """A model patched in eval mode with dropout in its config: in training mode (even under no_grad) HF's forwards
    apply the dropout exactly as HF's model does (same random stream); back in eval mode the fused forwards run."""
    from transformers import AutoModelForCausalLM

    cfg = rm.config(name)
    cfg.attention_dropout = 0.3
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    model = copy.deepcopy(ref)
    patch_model(model)
    ids = ids_for(ref)
    outs = []
    for m in (ref, model):
        m.train()
        torch.manual_seed(1)
        outs.append(logits(m, ids))
        m.eval()
    assert close(outs[1], outs[0]) and max_err(outs[0], logits(ref, ids)) > 1e-3
    with linear_calls() as calls:
        logits(model, ids)
    assert calls[0] == 1


# ---- weights changed after patching -----------------------------------------------------------------------------


def first_q(model):
    attn = attention(layers(model)[0])
    return attn.q_proj.weight if hasattr(attn, "q_proj") else attn.query_key_value.weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ARCHS)
def test_changed_weights_are_followed(name, device):
    """load_state_dict (copying, and with assign=True), an optimizer step, a `.data` assignment and casts: the
    patched logits equal HF's after each, and the fused forwards run on the new weights (plans rebuilt)."""
    ref, model = twins(name, device)
    ids = ids_for(ref)

    def check(what):
        assert close(logits(model, ids), logits(ref, ids)), what
        with linear_calls() as calls:
            logits(model, ids)
        assert calls[0] == 1, f"{what}: the fused forwards should run on the new weights"

    state = rm.build(name, device=device, seed=7).state_dict()
    for m in (ref, model):
        m.load_state_dict(state)
    check("load_state_dict")
    state = rm.build(name, device=device, seed=8).state_dict()
    for m in (ref, model):
        m.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    check("load_state_dict(assign=True)")
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        m.train()
        m(ids, labels=ids).loss.backward()
        opt.step()
        m.eval()
    check("an optimizer step")
    for m in (ref, model):
        first_q(m).data = first_q(m).data * 1.5
    check("a .data assignment")
    for dtype in (torch.bfloat16, torch.float16):
        for m in (ref, model):
            m.to(dtype)
        low, hf = logits(model, ids).float(), logits(ref, ids).float()
        exact = logits(copy.deepcopy(ref).float(), ids)  # the same rounded weights in fp32
        assert max_err(low, exact) <= 2 * max_err(hf, exact) + 1e-2 * exact.abs().max().item(), dtype
        assert model._patcher_state.report.dtype == str(dtype).removeprefix("torch.")  # every plan, norms included
        for m in (ref, model):
            m.float()
        check(f"{dtype} and back")
    first_q(model).data = first_q(model).data.clone()
    with torch.inference_mode():  # plans rebuilt in inference mode leave trainable parameters
        model(ids)
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        m(ids, labels=ids).loss.backward()
    assert_grads_equal(ref, model)
    assert "weights changed after patching" in " ".join(model._patcher_state.report.messages)
    assert model._patcher_state.report.dtype == "float32"
    assert unpatch_model(model) and torch.equal(logits(model, ids), logits(ref, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ARCHS)
def test_device_moves_are_followed(name):
    """A model patched on the CPU (reference ops) and moved to CUDA runs the kernels there, and back."""
    ref, model = twins(name)
    ids = ids_for(ref)
    for m in (ref, model):
        m.cuda()
    assert close(logits(model, ids.cuda()), logits(ref, ids.cuda()))
    assert model._patcher_state.report.backend == "kernels"
    for m in (ref, model):
        m.cpu()
    assert close(logits(model, ids), logits(ref, ids))
    assert model._patcher_state.report.backend == "reference"


def greedy(model, ids, new_tokens=12):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, eos_token_id=None)  # fmt: skip


@pytest.mark.parametrize("name", ARCHS)
def test_decode_runner_is_rebuilt_after_weights_change(name):
    """The decode runner never decodes with stale weights: check_weights (once per generate call) drops it where any
    weight was replaced, updated or re-tied, and a new one decodes HF's tokens on the new weights."""
    ref, model = twins(name)
    state = model._patcher_state
    ids = ids_for(ref, batch=1, tokens=5)

    def runner_tokens():
        state.runner = state.runner or DecodeRunner(model, EAGER)
        return state.runner.generate(ids, torch.ones_like(ids), 12, Sampling(), eos=[], pad_token_id=0)

    assert torch.equal(runner_tokens(), greedy(ref, ids))
    assert not state.check_weights(model) and state.runner is not None
    state_dict = rm.build(name, seed=9).state_dict()
    for m in (ref, model):
        m.load_state_dict({k: v.clone() for k, v in state_dict.items()}, assign=True)
    with pytest.raises(RuntimeError, match="weights changed since this DecodeRunner was built"):
        runner_tokens()  # a runner kept by hand refuses rather than decode with the old weights
    state.runner = None  # one built by hand before any forward or generate call plans from the new weights
    assert torch.equal(runner_tokens(), greedy(ref, ids))
    for m in (ref, model):
        with torch.no_grad():
            m.get_output_embeddings().weight.mul_(1.25)  # in place: the same memory, a new version
    assert state.check_weights(model) and state.runner is None
    assert torch.equal(runner_tokens(), greedy(ref, ids))
    for m in (ref, model):
        m.config.tie_word_embeddings = True
        m.tie_weights()
    assert state.check_weights(model)
    assert torch.equal(runner_tokens(), greedy(ref, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ARCHS)
def test_graph_decode_follows_changed_weights(name):
    """On CUDA, generate's captured graphs are dropped and recaptured after a weight change: the tokens stay HF's."""
    ref, model = twins(name, "cuda")
    ids = ids_for(ref, batch=1, tokens=5)
    assert torch.equal(greedy(model, ids), greedy(ref, ids)) and generate_path(model)["path"] == "graph"
    for change in ("assign", "in place", "cast"):
        for m in (ref, model):
            if change == "assign":
                state_dict = rm.build(name, device="cuda", seed=11).state_dict()
                m.load_state_dict({k: v.clone() for k, v in state_dict.items()}, assign=True)
            elif change == "in place":
                with torch.no_grad():
                    first_q(m).mul_(1.5)
            else:
                m.half().float()  # new memory, rounded values
        assert torch.equal(greedy(model, ids), greedy(ref, ids)), change
        assert generate_path(model)["path"] == "graph"


# ---- hooks ------------------------------------------------------------------------------------------------------


def hooks(model, seen):
    """Registrations of hooks at every boundary the patched stack fuses across; `seen` collects what they receive."""
    stack = layers(model)

    def record(key):
        return lambda module, args, out: seen.setdefault(key, []).append((args, out))

    def steer(module, args):
        return (args[0] + 0.5, *args[1:])

    return [
        lambda: stack[0].register_forward_hook(record("layer0")),
        lambda: stack[1].register_forward_pre_hook(steer),
        lambda: stack[1].input_layernorm.register_forward_hook(record("norm1")),
        lambda: next(attention(stack[2]).children()).register_forward_hook(record("projection2")),
        lambda: final_norm(model).register_forward_pre_hook(lambda m, args: seen.setdefault("final", []).append(args)),
    ]


def flat(value) -> list:
    """The tensors in `value` (nested tuples and lists flattened), and the types of its other values."""
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in flat(v)]
    return [value if isinstance(value, torch.Tensor) else type(value)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ARCHS)
def test_hooks_see_what_hf_gives(name, device):
    """Forward hooks and pre-hooks on a layer, a norm, a projection and the final norm (a pre-hook steering the
    hidden state), registered before and after patching: they receive HF's types and values, the logits are HF's,
    the report notes the fusions skipped, and removing the hooks brings the fused path back."""
    ref = rm.build(name, device=device)
    model = copy.deepcopy(ref)
    seen_ref, seen = {}, {}
    for register in hooks(ref, seen_ref):
        register()
    registrations = hooks(model, seen)
    handles = [register() for register in registrations[:2]]  # two registered before patching, three after
    report = patch_model(model)
    handles += [register() for register in registrations[2:]]
    ids = ids_for(ref)
    assert close(logits(model, ids), logits(ref, ids))
    assert seen.keys() == seen_ref.keys()
    for key, values in seen_ref.items():
        got, want = flat(seen[key]), flat(values)
        assert [type(g) for g in got] == [type(w) for w in want], key
        for g, w in zip(got, want):
            if isinstance(w, torch.Tensor):
                assert g.shape == w.shape and close(g, w), key
    notes = " ".join(report.messages)
    assert "hands on the summed tensor" in notes and "input_layernorm" in notes
    assert "hook" in model_reason(model)
    for h in handles:
        h.remove()
    with linear_calls() as calls:
        logits(model, ids)
    assert calls[0] == 1


# ---- adapters ---------------------------------------------------------------------------------------------------


class LoraLinear(nn.Module):
    """Wraps a Linear the way peft's LoRA layer does: base_layer(x) + B(A(x)) * scale."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)
        nn.init.normal_(self.lora_B.weight, std=0.1)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * 0.5


TARGETS = {
    "llama": ["q_proj", "v_proj", "up_proj"],
    "qwen2": ["k_proj", "gate_proj"],
    "gpt_neox": ["query_key_value", "dense_h_to_4h"],
}


def inject(model, seed=0):
    torch.manual_seed(seed)
    for module in list(model.modules()):
        for name in TARGETS[model.config.model_type]:
            child = module._modules.get(name)
            if isinstance(child, nn.Linear):
                setattr(module, name, LoraLinear(child))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ARCHS)
def test_lora_wrapped_projections_are_served(name, device):
    """Projections replaced by a LoRA wrapper after patching: the attention/MLP runs HF's forward (the report says
    why, the decode runner declines), outputs and adapter gradients are HF's; restoring the Linear brings the fused
    plan back."""
    ref, model = twins(name, device)
    ids = ids_for(ref)
    for m in (ref, model):
        inject(m)
    assert close(logits(model, ids), logits(ref, ids))
    assert "HF's forward runs" in " ".join(model._patcher_state.report.messages)
    assert "run HF's forward" in model_reason(model)
    for m in (ref, model):
        m.requires_grad_(False)
        for n, p in m.named_parameters():
            p.requires_grad_("lora_" in n)
        m.train()
        m(ids, labels=ids).loss.backward()
    assert_grads_equal(ref, model)
    for m in (ref, model):  # merge and unload, as peft does: the adapters folded into the base weights
        m.eval()
        for module in list(m.modules()):
            for child_name, child in list(module._modules.items()):
                if isinstance(child, LoraLinear):
                    with torch.no_grad():
                        child.base_layer.weight += 0.5 * child.lora_B.weight @ child.lora_A.weight
                    setattr(module, child_name, child.base_layer)
    assert close(logits(model, ids), logits(ref, ids))
    with linear_calls() as calls:
        logits(model, ids)
    assert calls[0] == 1 and not model._patcher_state.unplanned()


@pytest.mark.parametrize("name", ARCHS)
def test_peft_lora_is_served(name):
    """peft's own LoRA (get_peft_model after patching, then merge_and_unload): HF's outputs and adapter gradients."""
    peft = pytest.importorskip("peft")
    ref, model = twins(name)
    ids = ids_for(ref)
    config = peft.LoraConfig(r=4, target_modules=TARGETS[ref.config.model_type], init_lora_weights=False)
    wrapped = []
    for m in (ref, model):
        torch.manual_seed(0)
        wrapped.append(peft.get_peft_model(m, copy.deepcopy(config)))
    assert close(logits(wrapped[1], ids), logits(wrapped[0], ids))
    for w in wrapped:
        w.train()
        w(input_ids=ids, labels=ids).loss.backward()
    assert_grads_equal(*wrapped)
    merged = [w.merge_and_unload().eval() for w in wrapped]
    assert close(logits(merged[1], ids), logits(merged[0], ids))
    with linear_calls() as calls:
        logits(merged[1], ids)
    assert calls[0] == 1


@pytest.mark.parametrize("name", ARCHS)
def test_copies_and_unpatch_keep_their_own_weights(name):
    """A deepcopy of a patched model rebuilds its plans from its own weights (the copied plans read the original's),
    and unpatch_model with an adapter in place gives every projection its own storage again."""
    ref, model = twins(name)
    ids = ids_for(ref)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    assert close(logits(twin, ids), logits(ref, ids))
    for m in (ref, twin):
        inject(m)
    logits(twin, ids)
    assert unpatch_model(twin) and torch.equal(logits(twin, ids), logits(ref, ids))
    base = [p for n, p in twin.named_parameters() if "base_layer" in n]
    assert base and all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in base)
