"""GPT-NeoX's MLP on the main stream and on the branch stream of the graph decode: shared by the decode and GPTQ
tests."""

from patcher.decode import DecodeOptions, DecodeRunner, Sampling


def one_and_two_stream_tokens(model, ids, mask, options: DecodeOptions | None = None) -> dict:
    """Greedy tokens of the graph-captured decode with GPT-NeoX's MLP on the main stream and on its branch stream."""
    options = options or DecodeOptions()
    tokens = {}
    for branch in (False, True):
        runner = DecodeRunner(model, options.replace(parallel_branch=branch))
        assert (runner.decode_step.branch_stream is not None) == branch
        tokens[branch] = runner.generate(ids, mask, 40, Sampling(), eos=[], pad_token_id=0)
    return tokens
