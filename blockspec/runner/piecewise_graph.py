"""Piecewise CUDA graphs for prefill/extend: graphs for everything between attentions, attention eager.

The segments are the model's pieces (`CausalLM.run_piece`, the same code the eager forward runs): [embed + layer 0
up to attention], [layer i-1 after attention + layer i up to attention] for i in 1..L-1, and [layer L-1 after
attention + final norm]. Here they run on static buffers (sized for the largest bucket, sliced per bucket) that
they leave their results in, so one graph per (segment, token bucket) can be replayed for any batch whose token
count rounds up to that bucket. Segments also store the new K/V (fused with rope) at a static slot buffer whose
padding rows point at the dummy slot, so padding never writes a real KV slot; attention runs eagerly between
segments on the real tokens only, reading q/k/v as views of the projection buffer and writing its output into the
next segment's input buffer.

With `graph_attention` (the Triton backend, GraphExtendAttention) the attentions are captured too: one graph per
bucket runs every piece and every attention, its launch shape fixed per bucket and the batch's layout read from
static buffers loaded before the replay (≈ 3 ms less host time per extend on a 30-layer model).

The hidden-capture mode (which layer outputs are returned for every token) is fixed at construction and used both
at capture and at replay; a batch asking for another mode is refused by `can_run` and runs eagerly.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Optional

import torch

from blockspec.attention.base import AttentionBackend
from blockspec.attention.triton_graph_extend import GraphExtendAttention
from blockspec.batch import ForwardBatch, ForwardMode
from blockspec.models.llama import CausalLM, ModelOutput
from blockspec.models.pieces import PieceState
from blockspec.runner.gc_pause import garbage_collection_paused

logger = logging.getLogger(__name__)

AuxConsumer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
WHOLE = -1  # NOTE: the graphs key of a bucket's whole-forward graph (graph_attention), beside (piece index, bucket)


def default_buckets(max_tokens: int) -> list[int]:
    """4..32 step 4, 48..256 step 16, 288..512 step 32, 576..1024 step 64, 1280..4096 step 256, then step 512 up to
    max_tokens (and max_tokens itself)."""
    ranges = [(4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256),
              (4608, max(max_tokens, 4608), 512)]
    buckets = sorted({n for lo, hi, step in ranges for n in range(lo, hi + 1, step) if n <= max_tokens})
    if not buckets or buckets[-1] < max_tokens:
        buckets.append(max_tokens)
    return buckets


def bucket_for(buckets: list[int], num_tokens: int) -> Optional[int]:
    index = bisect.bisect_left(buckets, num_tokens)
    return buckets[index] if index < len(buckets) else None


class PiecewiseGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        buckets: list[int],
        capture_layer_ids: tuple[int, ...],
        device: torch.device,
        pool: Optional[tuple[int, int]] = None,
        aux_consumer: Optional[AuxConsumer] = None,
        graph_attention: Optional[GraphExtendAttention] = None,
    ) -> None:
        """`aux_consumer(aux [n, len(capture_layer_ids) * hidden], positions [n], slots [n])` runs at the end of the
        last segment, inside its graph (DFlash: writes the draft KV); padding rows carry the dummy slot, so it must
        write only at `slots`."""
        cfg = model.config
        self.model = model
        self.backend = backend
        self.buckets = sorted(set(buckets))
        self.capture_layer_ids = capture_layer_ids
        self.device = device
        self.pool = pool
        self.aux_consumer = aux_consumer if capture_layer_ids else None
        self.graph_attention = graph_attention
        n, h, dtype = self.buckets[-1], cfg.hidden_size, model.lm_head.weight.dtype

        def buffer(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=kind, device=device)

        attention = model.model.layers[0].self_attn  # NOTE: this rank's heads under tensor parallelism
        attention_width = attention.q_size
        self.input_ids = buffer(n, kind=torch.int64)
        self.positions = buffer(n, kind=torch.int64)
        self.out_cache_loc = buffer(n, kind=torch.int64)
        self.qkv = buffer(n, attention_width + 2 * attention.kv_size)
        self.attn = buffer(n, attention_width)
        self.residual = buffer(n, h)
        self.mlp_out = buffer(n, h)
        self.hidden = buffer(n, h)
        self.aux_all = buffer(n, len(capture_layer_ids) * h)  # the captured layers side by side, in order
        # NOTE: views for inspection only; the model's pieces write aux_all
        self.aux = {layer_id: self.aux_all[:, i * h:(i + 1) * h] for i, layer_id in enumerate(capture_layer_ids)}
        self.states: dict[int, PieceState] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def piece_state(self, n: int) -> PieceState:
        """The model's piece state over the first n rows of the static buffers (one per bucket, made once)."""
        if n not in self.states:
            self.states[n] = PieceState(
                self.input_ids[:n], self.positions[:n], self.out_cache_loc[:n], self.backend.pool,
                self.capture_layer_ids, static_buffers=True, qkv=self.qkv[:n], attn_out=self.attn[:n],
                residual=self.residual[:n], mlp_out=self.mlp_out[:n], aux=self.aux_all[:n], hidden=self.hidden[:n],
            )
        return self.states[n]

    def segment(self, index: int, n: int) -> None:
        """The model's piece `index` on the static buffers of bucket n; the last also feeds the aux consumer.
        NOTE: padding rows carry slot 0 (the dummy page's), so their K/V (and draft KV) land there."""
        state = self.piece_state(n)
        self.model.run_piece(index, state)
        if index == self.model.num_pieces - 1 and self.aux_consumer is not None:
            self.aux_consumer(self.aux_all[:n], self.positions[:n], self.out_cache_loc[:n])

    def whole_forward(self, n: int) -> None:
        """Every piece and every attention on the static buffers of bucket n, the attention over the batch that
        `graph_attention` holds (captured as one graph per bucket)."""
        assert self.graph_attention is not None
        plan = self.graph_attention.make_tile_table(n)
        q = self.model.split_qkv(self.qkv[:n])[0]
        last = self.model.num_pieces - 1
        for index in range(self.model.num_pieces):
            self.segment(index, n)
            if index < last:
                self.graph_attention.forward(q, index, self.attn[:n], plan)

    # ---- capture and replay -------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        with garbage_collection_paused():
            self._capture()

    def _capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        # NOTE: the eager warm-up below really stores K/V (and draft KV): point every row at the dummy slot first.
        for static in (self.input_ids, self.positions, self.out_cache_loc):
            static.zero_()
        if self.graph_attention is not None:
            self.graph_attention.q_lens.zero_()  # NOTE: no request: the warm-ups' attention has no tiles
        for n in reversed(self.buckets):
            if self.graph_attention is not None:
                self.whole_forward(n)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.whole_forward(n)
                self.graphs[(WHOLE, n)] = graph
                continue
            for index in range(self.model.num_pieces):
                self.segment(index, n)  # NOTE: warm-up compiles kernels before capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.segment(index, n)
                self.graphs[(index, n)] = graph
        logger.info(
            "captured piecewise graphs: %d buckets x %d graphs in %.1f s, %.0f MiB",
            len(self.buckets),
            1 if self.graph_attention is not None else self.model.num_pieces,
            time.perf_counter() - start,
            (torch.cuda.memory_allocated(self.device) - before) / 2**20,
        )

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.mode is ForwardMode.EXTEND
            and tuple(batch.capture_layer_ids) == self.capture_layer_ids
            and bucket_for(self.buckets, batch.num_tokens) is not None
            and (self.graph_attention is None or self.graph_attention.can_take(batch))
        )

    def forward(self, batch: ForwardBatch, use_graphs: bool = True) -> ModelOutput:
        """Runs the batch segment by segment; `use_graphs=False` runs the same segments eagerly (tests, CPU)."""
        t = batch.num_tokens
        n = bucket_for(self.buckets, t)
        assert n is not None
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.out_cache_loc[:t].copy_(batch.out_cache_loc)
        if n > t:
            self.input_ids[t:n].zero_()
            self.positions[t:n].zero_()
            self.out_cache_loc[t:n].zero_()  # NOTE: slot 0 is the dummy page's: padding rows never touch real KV
        if self.graph_attention is not None:
            self.graph_attention.load(batch)
            if use_graphs:
                self.graphs[(WHOLE, n)].replay()
            else:
                self.whole_forward(n)
            return self.output(batch, t)
        batch.attn_meta = self.backend.plan(batch)
        run: Callable[[int], None] = (
            (lambda i: self.graphs[(i, n)].replay()) if use_graphs else (lambda i: self.segment(i, n))
        )
        q, k, v = self.model.split_qkv(self.qkv[:t])  # NOTE: attention runs on the real rows only
        for index in range(self.model.num_pieces):
            run(index)
            if index < self.model.num_pieces - 1:
                self.backend.forward(q, k, v, index, batch, kv_stored=True, out=self.attn[:t])
        return self.output(batch, t)

    def output(self, batch: ForwardBatch, t: int) -> ModelOutput:
        hidden = self.hidden[:t].clone()  # NOTE: the static buffer is overwritten by the next extend
        # NOTE: aux is a view of the static buffer: valid until the next extend (its consumer, if any, already ran).
        aux = self.aux_all[:t] if self.capture_layer_ids else None
        logits = self.model.compute_logits(hidden[batch.logits_rows])
        return ModelOutput(logits, aux, hidden, aux_consumed=self.aux_consumer is not None)
