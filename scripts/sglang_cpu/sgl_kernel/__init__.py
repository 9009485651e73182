"""A stand-in for ``sgl_kernel`` on CPU test servers (on ``PYTHONPATH`` only for them).

The package registry has no CPU build of SGLang's kernel package; its CPU engine path imports a few ops from it. The
one that path calls for a plain (non-AMX) CPU, ``assign_req_to_token_pool_cpu``, is written here in torch; any other
op raises ``NotImplementedError`` when called, so a path that needs a real kernel fails loudly.
"""

import torch

__version__ = "0.0.0+agentflow.cpu"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots (``out_cache_loc``, packed request after request) into its row."""
    pos = 0
    rows, starts, ends = req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    for row, start, end in zip(rows, starts, ends, strict=True):
        count = end - start
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[pos : pos + count].to(req_to_token.dtype)
        pos += count


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in (agentflow's SGLang test server)")

    missing.__name__ = name
    return missing
