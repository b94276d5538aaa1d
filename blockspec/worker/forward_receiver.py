"""A worker rank's side of the forward mirror (runner/mirror.py): receives each forward rank 0 sends and runs it on
this rank's shard, through the same entry point of its own worker, until rank 0 stops it."""
from __future__ import annotations

from typing import Union

import torch

from blockspec.batch import DeviceRows, ForwardBatch, GraphInputs, UniformRows
from blockspec.distributed.group import TensorParallel
from blockspec.runner.graph_kind import GraphKind, tokens_per_request
from blockspec.runner.mirror import Form, HEADER_LEN, KINDS, MODES, Op
from blockspec.worker.protocol import Worker


class ForwardReceiver:
    """A worker rank's side: receives each forward and runs it on its own shard, until rank 0 stops it."""

    def __init__(self, tp: TensorParallel, worker: Worker) -> None:
        self.tp = tp
        self.worker = worker
        self.table = worker.runner.req_to_token.table

    def serve(self) -> None:
        while self.step():
            pass

    def step(self) -> bool:
        """Receives and runs one forward; False once rank 0 sent STOP."""
        header = self.tp.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=self.table.device)).tolist()
        op = Op(header[0])
        if op is Op.STOP:
            return False
        switches, num_host, size = header[-3:]
        runner = self.worker.runner
        runner.graphs.enabled, runner.piecewise_enabled = bool(switches & 1), bool(switches & 2)
        payload = self.tp.broadcast(torch.empty(size, dtype=torch.int64, device=self.table.device))
        host, tensors = payload[:num_host].tolist(), payload[num_host:]
        with torch.inference_mode():
            if Form(header[2]) is Form.BATCH:
                batch = self._batch(header, host, tensors)
                if op is Op.EXTEND:
                    self.worker.extend_forward(batch)
                else:
                    self._uniform(KINDS[header[1]], batch)
            else:
                self._uniform(KINDS[header[1]], self._rows(header, host, tensors))
        return True

    def _uniform(self, kind: GraphKind, inputs: GraphInputs) -> None:
        fn = self.worker.uniform_forward_fn(kind, tokens_per_request(inputs))
        self.worker.runner.graphs.run(kind, inputs, fn)

    def _write_table(self, req_rows: torch.Tensor, flat_rows: torch.Tensor) -> None:
        self.table[req_rows] = flat_rows.view(req_rows.numel(), self.table.shape[1])

    def _batch(self, header: list[int], host: list[int], tensors: torch.Tensor) -> ForwardBatch:
        mode, t, bs, num_logits, flags, hint, q_len = MODES[header[3]], *header[4:10]
        has_extend = bool(flags & 2)
        sizes = [t, t, t, bs, bs, num_logits, *([bs, bs] if has_extend else [])]
        parts = list(tensors.split([*sizes, tensors.numel() - sum(sizes)]))
        input_ids, positions, out_cache_loc, req_rows, seq_lens, logits_rows = parts[:6]
        self._write_table(req_rows, parts[-1])
        return ForwardBatch(
            mode=mode, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc, req_rows=req_rows,
            seq_lens=seq_lens, seq_lens_cpu=host[:bs], extend_lens_cpu=host[bs:2 * bs], logits_rows=logits_rows,
            req_to_token=self.table, capture_layer_ids=tuple(host[2 * bs:]),
            uniform_q_len=None if q_len < 0 else q_len, max_seq_len_hint=None if hint < 0 else hint,
            float_logits=bool(flags & 1), argmax_only=bool(flags & 4), extend_starts=parts[6] if has_extend else None,
            extend_lens=parts[7] if has_extend else None,
        )

    def _rows(self, header: list[int], host: list[int], tensors: torch.Tensor) -> Union[UniformRows, DeviceRows]:
        mode, form, bs, width = MODES[header[3]], Form(header[2]), header[4], header[5]
        rows, table_rows = tensors.split([bs * width, tensors.numel() - bs * width])
        rows = rows.view(bs, width)
        self._write_table(rows[:, width - 2], table_rows)
        if form is Form.DEVICE_ROWS:
            return DeviceRows(mode, rows, tuple(host))
        host_rows = rows.cpu().pin_memory() if rows.is_cuda else rows.clone()
        return UniformRows(mode, host_rows, tuple(host))
