"""One training run of ``lck demo``: the loop, its timings and memory, and what it records.

Shared by :mod:`lck_megatron.demo` (which runs it) and :mod:`lck_megatron._demo_report` (which prints and
draws its results), so that neither imports the other.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_mib: float = 0.0
    peak_kind: str = ""
    tokens_per_step: int = 0
    warmup: int = 1
    lck_calls: dict[str, dict[str, int]] = field(default_factory=dict)  # Megatron path: what lck ran

    @property
    def tokens_per_s(self) -> float:
        timed = sorted(self.step_s[self.warmup :] or self.step_s)
        return self.tokens_per_step / timed[len(timed) // 2]

    def final_loss(self) -> float:
        tail = self.losses[-max(1, len(self.losses) // 10) :]
        return sum(tail) / len(tail)


def rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def report_every(steps: int) -> int:
    return max(1, steps // 20)  # about 20 progress lines per run


def train(
    name: str, step_fn: Any, model: Any, data: Any, shape: Any, device: Any, progress: Any
) -> RunResult:
    """``data.shape[0]`` steps of ``step_fn`` (forward, returning the loss) + backward + AdamW on float32
    masters; per-step wall time (synchronised on CUDA), losses, and the peak memory of the run."""
    import torch

    from lck_megatron._demo_models import MasterWeightAdamW

    opt = MasterWeightAdamW(list(model.parameters()), lr=shape.lr)
    steps = data.shape[0]
    res = RunResult(name, tokens_per_step=shape.batch * shape.seq, warmup=max(2, steps // 10))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss = rss_mib()
    for i in range(steps):
        batch = data[i].to(device, non_blocking=True)
        t0 = time.perf_counter()
        loss = step_fn(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step(i, steps)
        if cuda:
            torch.cuda.synchronize()
        res.step_s.append(time.perf_counter() - t0)
        res.losses.append(float(loss.detach()))
        if not cuda:
            rss = max(rss, rss_mib())
        if (i + 1) % report_every(steps) == 0:
            progress.step(f"{name} step {i + 1} loss {res.losses[-1]:.3f}")
    if cuda:
        res.peak_mib, res.peak_kind = torch.cuda.max_memory_allocated() / 2**20, "CUDA peak allocated"
    else:
        res.peak_mib, res.peak_kind = rss, "process RSS"
    return res


def copy_weights(dst: Any, src_state: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        own = dict(dst.named_parameters())
        missing = sorted(set(own) - set(src_state))
        if missing:
            raise RuntimeError(f"lck demo: the lck model has parameters the stock model lacks: {missing[:5]}")
        for k, p in own.items():
            p.copy_(src_state[k])
