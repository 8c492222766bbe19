"""A tiny model of the random configs packed to GPTQ int4 and loaded back, for the tests under tests/gptq."""

from __future__ import annotations

import torch

from patcher import load_gptq
from patcher import random_models as rm
from patcher.decode import DecodeOptions
from patcher.gptq.pack import pack_model

EAGER = DecodeOptions(use_graphs=False)


def gptq_model(name, tmp_path, act_order=False, dtype=torch.float32, device="cpu", group_size=64):
    pack_model(rm.build(name), tmp_path / "q", group_size=group_size, act_order=act_order)
    model = load_gptq(tmp_path / "q", dtype=dtype, device_map=device)
    model.generation_config.eos_token_id = None
    return model
