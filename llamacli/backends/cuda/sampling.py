"""Sampling on the device (kernels/sampling.cu): penalties, then argmax (greedy), or top-k (k <= TOPK_MAX) and
the rest of llamacli.sampling's chain over the candidates (top-p, min-p, temperature, the draw with the
uniform number the host's seeded generator supplies): only the chosen id crosses, and the tokens equal
llamacli.sampling's for the same seed (tests/test_gpu_kernels.py). top_k = 0 or > TOPK_MAX copies the logits
and samples on the host."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import NumericalError
from . import loader as K
from .profile import profiled

TOPK_MAX = 1024  # device top-k candidates


class SamplingMixin:
    """Mixed into backend.CudaBackend; its buffers (_topk_vals, _topk_ids, _sample_out) come from
    decode.DecodeMixin.alloc_step_io."""

    cp: Any
    cfg: Any

    @profiled("sampling")
    def sample(self, logits: Any, params: Any, rng: np.random.Generator, recent: list[int]) -> int:
        from ... import sampling as S

        cp, v = self.cp, self.cfg.vocab_size
        params.validate()
        if not params.greedy and not 0 < params.top_k <= TOPK_MAX:
            return S.sample(self.to_host(logits)[-1], params, rng, recent)  # host path (documented)
        x = self._f32(logits[-1]).copy()  # [V]; penalties write into it
        penal = params.repeat_last_n != 0 and (
            params.repeat_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        )
        if penal and recent:
            window = np.asarray(recent, dtype=np.int32)
            if params.repeat_last_n > 0:
                window = window[-params.repeat_last_n :]
            if window.size:
                hist = cp.asarray(window)
                K.launch("sampling", "penalties_f32", (1,), (256,),
                         (K.ptr(x), K.ptr(hist), K.i32(window.size), K.f32(params.repeat_penalty),
                          K.f32(params.frequency_penalty), K.f32(params.presence_penalty)))
        if params.greedy:
            out = cp.empty(2, dtype=cp.int32)
            K.launch("sampling", "argmax_f32", (1,), (1024,), (K.ptr(x), K.i32(v), K.ptr(out), K.ptr(None)))
            host = out.get()
            if host[1]:
                raise NumericalError("the logits contain NaN or +inf: the model output is broken")
            return int(host[0])
        k = min(params.top_k, v)
        K.launch("sampling", "topk_f32", (1,), (1024,),
                 (K.ptr(x), K.i32(v), K.i32(k), K.ptr(self._topk_vals), K.ptr(self._topk_ids)))
        # top-p, min-p, temperature and the draw over the k candidates, on the device too (sampling.cu):
        # the host's seeded generator supplies the one uniform number, and only the id comes back.
        out = self._sample_out
        log_min_p = math.log(params.min_p) if params.min_p > 0 else -math.inf
        K.launch("sampling", "sample_topk_f32", (1,), (1024,),
                 (K.ptr(self._topk_vals), K.ptr(self._topk_ids), K.i32(k), np.float64(params.top_p),
                  np.float64(log_min_p), np.float64(params.temperature), np.float64(rng.random()), K.ptr(out)))
        token, flag = (int(a) for a in out.get())
        if flag == 1:
            raise NumericalError("the logits contain NaN or +inf: the model output is broken")
        if flag == 2:
            raise NumericalError(f"all {v} logits are -inf: no token can be sampled")
        return token
