"""Engine: the offline API, shaped like SGLang's `sgl.Engine`."""
from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable, Iterator, Optional, Sequence, Union, cast

import torch

from blockspec.config.engine_config import EngineConfig
from blockspec.engine.compiles import by_kernel, kernel_compile_log
from blockspec.engine.rank_processes import RankProcesses, rank_failures
from blockspec.engine.server_info import EngineLoad, EngineSnapshot
from blockspec.engine.startup_report import StartupReport, WarmupReport
from blockspec.engine.workers import build_workers
from blockspec.models.hub import with_local_checkpoints
from blockspec.request import Req, build_requests, logprob_request, per_prompt
from blockspec.runner.deterministic import deterministic_info
from blockspec.runner.mirror import ForwardMirror
from blockspec.scheduler.scheduler import Scheduler
from blockspec.speculative.dflash import DFlashWorker
from blockspec.tokenizer import chat_to_ids, load_tokenizer
from blockspec.worker.protocol import Worker

logger = logging.getLogger(__name__)

SamplingArg = Union[None, dict[str, Any], Sequence[dict[str, Any]]]


class Engine:
    """`Engine(model_path=..., **flags)`; keywords are the CLI flags in snake_case."""

    def __init__(self, **kwargs: Any) -> None:
        """Start-up: weights, KV pool, graphs, piecewise graphs, then (on CUDA) the kernel warm-up, which compiles
        every Triton kernel variant serving can launch; `startup` reports the phases and what compiled."""
        started = time.perf_counter()
        config = EngineConfig.from_kwargs(**kwargs)
        self.model_id = config.model_path  # NOTE: what the user named (a directory or an `org/name` id)
        self.config = with_local_checkpoints(config)
        logging.basicConfig(level=self.config.log_level.upper())
        compile_log = kernel_compile_log()
        compiled_from = compile_log.count
        # NOTE: tensor parallelism: ranks 1..N-1 run in their own processes, mirroring this one's forwards
        self.ranks = RankProcesses(self.config) if self.config.tp_size > 1 else None
        self.mirror: Optional[ForwardMirror] = None
        with compile_log.startup(), rank_failures(self.ranks):
            self.tokenizer = None
            if not self.config.skip_tokenizer_init:
                self.tokenizer = load_tokenizer(
                    self.config.tokenizer_path or self.config.model_path, self.config.trust_remote_code,
                    self.config.chat_template)
            self.runner, self.worker = build_workers(self.config, None if self.ranks is None else self.ranks.tp)
            self.worker.init_cuda_graphs()
            if self.runner.forward_mirror is not None:
                self.mirror = self.runner.forward_mirror
                self.mirror.start()
            self.scheduler = self.new_scheduler()
            warmup = self._warm_kernels()
        self.compile_mark = compile_log.count  # NOTE: compiles from here on are stalls while serving
        phases = {**self.runner.startup_seconds, "graphs": self.runner.graphs.capture_seconds,
                  "kernels": warmup.seconds if warmup else 0.0}
        self.startup = StartupReport.build(phases, time.perf_counter() - started,
                                           compile_log.compiles[compiled_from:self.compile_mark], warmup)
        self.startup.log()
        if self.config.resolved_host_threads is not None:
            # NOTE: after loading (weights may be converted on the host with torch's threads), before serving
            torch.set_num_threads(self.config.resolved_host_threads)

    def _warm_kernels(self) -> Optional[WarmupReport]:
        """On CUDA, compiles every kernel variant serving can launch; None elsewhere (nothing compiles)."""
        if self.runner.device.type != "cuda":
            return None
        from blockspec.engine.warmup import warm_kernels  # NOTE: Triton is there whenever CUDA kernels run

        return warm_kernels(self.runner, self.worker, self.new_scheduler)

    def new_scheduler(self) -> Scheduler:
        """A scheduler over this engine's worker, pool and table (the engine's own, or the kernel warm-up's)."""
        target = self.runner.target_config
        eos = list(target.eos_token_ids)
        if (
            self.tokenizer is not None
            and self.tokenizer.eos_token_id is not None
            and self.tokenizer.eos_token_id not in eos
        ):
            eos.append(int(self.tokenizer.eos_token_id))
        return Scheduler(self.config, self.worker, self.runner.allocator, self.runner.req_to_token,
                         self.runner.context_length, target.vocab_size, eos, self.tokenizer, self.runner.device)

    @property
    def kernel_compiles_after_startup(self) -> Optional[int]:
        """Triton kernel variants compiled in this process since this engine's start-up finished, outside any other
        engine's start-up (should stay 0); None where they cannot be counted (no Triton, or one without its hook)."""
        compile_log = kernel_compile_log()
        return len(compile_log.stalls_since(self.compile_mark)) if compile_log.counting else None

    @property
    def dflash_worker(self) -> Optional[DFlashWorker]:
        """The DFlash worker (benchmarks instrument its forwards); None without DFlash. NOTE: DFlash is the only
        speculative worker; the engine itself reads workers through the Worker protocol."""
        return cast(DFlashWorker, self.worker) if self.worker.is_speculative else None

    @property
    def kernel_compiles_after_startup_by_kernel(self) -> dict[str, int]:
        """Those variants per kernel name, most first (each is also logged as a warning when it happens)."""
        compile_log = kernel_compile_log()
        return by_kernel(compile_log.stalls_since(self.compile_mark)) if compile_log.counting else {}

    # ---- inputs ----------------------------------------------------------------------------
    def _prompts_to_ids(
        self, prompt: Union[None, str, list[str]], input_ids: Union[None, list[int], list[list[int]]]
    ) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        if input_ids is not None:
            if not isinstance(input_ids, list) or not input_ids:
                raise ValueError("input_ids must be a non-empty list of token ids or of lists of token ids")
            single = all(isinstance(t, int) for t in input_ids)
            batch = [input_ids] if single else input_ids
            for ids in batch:
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("input_ids must contain lists of integers")
            return [list(ids) for ids in batch], single  # type: ignore[arg-type]
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this engine runs with skip_tokenizer_init=True")
        single = isinstance(prompt, str)
        texts = [prompt] if single else prompt
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt must be a string or a list of strings")
        return [list(self.tokenizer.encode(t)) for t in texts], single

    def chat_input_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("chat messages need a tokenizer; this engine runs with skip_tokenizer_init=True")
        return chat_to_ids(self.tokenizer, messages)

    def make_requests(
        self,
        prompt: Union[None, str, list[str]] = None,
        input_ids: Union[None, list[int], list[list[int]]] = None,
        sampling_params: SamplingArg = None,
        rid: Union[None, str, list[str]] = None,
        return_logprob: Union[bool, list[bool]] = False,
        top_logprobs_num: Union[int, list[int]] = 0,
    ) -> tuple[list[Req], bool]:
        """Validates everything first, so a bad request leaves nothing queued."""
        batch, single = self._prompts_to_ids(prompt, input_ids)
        rids = [rid] if isinstance(rid, str) else rid
        reqs = build_requests(batch, sampling_params, rids, self.scheduler.limits)
        for req, wanted, top_n in zip(reqs, per_prompt(return_logprob, len(reqs), "return_logprob"),
                                      per_prompt(top_logprobs_num, len(reqs), "top_logprobs_num")):
            req.top_logprobs_num = logprob_request(wanted, top_n)
        return reqs, single

    # ---- offline API -----------------------------------------------------------------------
    def generate(
        self,
        prompt: Union[None, str, list[str]] = None,
        sampling_params: SamplingArg = None,
        input_ids: Union[None, list[int], list[list[int]]] = None,
        rid: Union[None, str, list[str]] = None,
        return_logprob: Union[bool, list[bool]] = False,
        top_logprobs_num: Union[int, list[int]] = 0,
    ) -> Union[dict[str, Any], list[dict[str, Any]]]:
        """SGLang's `Engine.generate`; with `return_logprob`, meta_info carries the target's log-probabilities of the
        output tokens (`output_token_logprobs`) and of its `top_logprobs_num` most likely tokens per position."""
        reqs, single = self.make_requests(prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num)
        outputs = dict(self._run(reqs, len(reqs)))
        return outputs[0] if single else [outputs[i] for i in range(len(reqs))]

    def generate_iter(self, input_ids: list[list[int]], sampling_params: SamplingArg = None,
                      on_step: Optional[Callable[[int], None]] = None) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yields (prompt index, `generate`'s output) as each request finishes, keeping the running batch full
        (4 x max_running_requests queued, topped up as requests finish), so a caller of a long run can keep results
        as they come. `on_step(tokens)`: after every engine step, the output tokens these requests hold so far (a
        progress bar's hook: requests that run together finish together). NOTE: closing it early leaves its queued
        requests in the engine."""
        reqs, _ = self.make_requests(input_ids=input_ids, sampling_params=sampling_params)
        yield from self._run(reqs, 4 * self.config.max_running_requests, on_step)

    def _run(self, reqs: list[Req], window: int,
             on_step: Optional[Callable[[int], None]] = None) -> Iterator[tuple[int, dict[str, Any]]]:
        """At most `window` unfinished at a time (collect_finished scans the queue each step). NOTE: yields outside
        rank_failures."""
        pending: dict[str, int] = {}
        queued = 0
        finished_tokens = 0
        while queued < len(reqs) or pending:
            with rank_failures(self.ranks):
                while queued < len(reqs) and len(pending) < window:
                    self.scheduler.add_request(reqs[queued])
                    pending[reqs[queued].rid] = queued
                    queued += 1
                if not self.scheduler.has_work:
                    raise RuntimeError(f"{len(pending)} request(s) left the scheduler unreported (a nested generate?)")
                finished = [(pending.pop(req.rid), req) for req in self.scheduler.step() if req.rid in pending]
            if on_step is not None:
                finished_tokens += sum(len(req.output_ids) for _, req in finished)
                on_step(finished_tokens + sum(len(reqs[index].output_ids) for index in pending.values()))
            for index, req in finished:
                yield index, self.output_of(req)

    @staticmethod
    def output_of(req: Req) -> dict[str, Any]:
        return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": req.meta_info()}

    def load(self) -> EngineLoad:
        """Requests and KV slots now (the engine process reads it every step)."""
        allocator = self.runner.allocator
        return EngineLoad(len(self.scheduler.running), len(self.scheduler.waiting), allocator.total_slots,
                          allocator.free_slots, allocator.unused_slots)

    def snapshot(self) -> EngineSnapshot:
        """The engine's state as get_server_info and the engine process report it."""
        return EngineSnapshot(
            load=self.load(), scheduler=self.scheduler.stats(), forward_counts=dict(self.runner.forward_counts),
            cuda_graph=bool(self.runner.graphs), radix_cache=self.radix_cache_stats(),
            kernel_compiles_after_startup=self.kernel_compiles_after_startup,
            kernel_compiles_after_startup_by_kernel=self.kernel_compiles_after_startup_by_kernel,
            speculative=self.worker.speculative_state(),
        )

    @property
    def forward_counts(self) -> dict[str, int]:
        """Forwards by how they ran since start-up: full graph replays and eager uniform forwards, piecewise extend
        replays and extend batches the piecewise graphs could not take (tests and benchmarks check the path)."""
        return dict(self.runner.forward_counts)

    def step(self) -> list[Req]:
        """One scheduler step of the requests queued with `add_request`; returns those that finished in it (tests
        and benchmarks drive the engine step by step with it)."""
        return self.scheduler.step()

    def get_server_info(self) -> dict[str, Any]:
        snapshot = self.snapshot()
        load, steps = snapshot.load, snapshot.scheduler
        internal: dict[str, Any] = {
            "attention_backend": self.runner.attention_backend,
            "cuda_graph": snapshot.cuda_graph,
            "forward_counts": snapshot.forward_counts,
            "num_running_reqs": load.num_running,
            "num_waiting_reqs": load.num_waiting,
            "num_retractions": steps.num_retractions,
            "num_steps": steps.num_steps,
            "num_extend_steps": steps.num_extend_steps,
            "step_seconds": steps.step_seconds,
            "extend_step_seconds": steps.extend_step_seconds,
            "num_mixed_steps": steps.num_mixed_steps,
            "num_steps_arrivals_held": steps.num_steps_arrivals_held,
            "radix_cache": snapshot.radix_cache,
            "kernel_compiles_after_startup": snapshot.kernel_compiles_after_startup,
            "kernel_compiles_after_startup_by_kernel": snapshot.kernel_compiles_after_startup_by_kernel,
        }
        if snapshot.speculative is not None:
            internal.update(steps.spec)
            internal["verify_length"] = snapshot.speculative.verify_length
        return {
            "model_path": self.config.model_path,
            "speculative_algorithm": self.config.speculative_algorithm,
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).replace("torch.", ""),
            "context_length": self.runner.context_length,
            "page_size": self.config.page_size,
            "max_prefill_wait_steps": self.config.max_prefill_wait_steps,
            "prefill_wait_policy": self.config.prefill_wait_policy,
            "disable_radix_cache": self.config.disable_radix_cache,
            "tp_size": self.config.tp_size,
            # torch's intra-op threads in this engine's process (--host-threads)
            "host_threads": torch.get_num_threads(),
            "enable_deterministic_inference": self.config.enable_deterministic_inference,
            "deterministic_inference": deterministic_info(self.runner.batch_invariant_attention),
            "kv_cache": {"total_slots": load.kv_total_slots, "free_slots": load.kv_free_slots,
                         "unused_slots": load.kv_unused_slots},
            "startup": self.startup.as_dict(),
            "internal_states": [internal],
        }

    def flush_cache(self) -> bool:
        """SGLang's `Engine.flush_cache`: empties the radix prefix cache. Refused (False) while requests are queued or
        running, as in SGLang."""
        flushed = self.scheduler.flush_cache()
        if not flushed:
            logger.warning("flush_cache refused: %d requests running, %d waiting",
                           len(self.scheduler.running), len(self.scheduler.waiting))
        return flushed

    def radix_cache_stats(self) -> dict[str, Any]:
        """Hit rate, cached / looked-up prompt tokens and evictions since start; tokens held in the tree now."""
        return self.scheduler.prefix_cache.stats()

    def shutdown(self) -> None:
        """Aborts what is queued or running, stops the other ranks and lets go of the model, the KV pool and the
        graphs, so another engine can start in this process with the memory back. Safe to call twice."""
        if self.is_shut_down:
            return
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort(req.rid)
        self.scheduler.collect_finished()
        if self.ranks is not None:
            self.ranks.shutdown(None if self.mirror is None else self.mirror.stop)
        self._shut_down = True
        # NOTE: the runner, worker and scheduler reference each other: collected only by a cycle pass, after which
        # the caching allocator can hand the pages back
        del self.scheduler, self.worker, self.runner
        self.mirror = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @property
    def is_shut_down(self) -> bool:
        return bool(self.__dict__.get("_shut_down"))

    def __getattr__(self, name: str) -> Any:
        """Reached only for missing attributes: after `shutdown`, the parts it let go of."""
        if name in ("scheduler", "worker", "runner") and self.is_shut_down:
            raise RuntimeError("this Engine was shut down")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
