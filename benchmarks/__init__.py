"""The benchmarks: each module measures one live goal and writes a result JSON (and its plot) under
benchmarks/results/ or --out. Run one from the repository root as a module, e.g.
`python -m benchmarks.step_latency --batch-sizes 1 32 --contexts 512`; draw a result again with
`python -m benchmarks.plots RESULT.json`.

- step_latency, prefill_latency, adaptive_verify, deterministic_cost: Llama-3.1-8B-shape step, prefill, adaptive
  verify and deterministic-mode costs on one GPU (device_timing: their timing and telemetry).
- serving_vs_engine (+ serving_vs_engine_support, serving_server, serving_workload, serving_tokenizers, serving_profile,
  merge_serving_results), prefix_cache (+ prefix_cache_rows, prefix_cache_workloads), warm_start, host_overhead:
  the HTTP server against the offline engine, the radix prefix cache, start-up and the serving loop's host time.
- greedy_drift, generation_rate, radix_evict: bf16 DFlash against target-only greedy, offline generation at wide
  batches, the radix tree's eviction.
- draft_v2 (+ draft_v2_data, draft_v2_report): the shipped SmolLM2 draft's training and evaluation (#24).
- results, plots: what the benchmarks share (the results directory, --out/--commit, JSON and plot writing; the
  figures).

One-off experiments left the tree at #48; benchmarks/HISTORY.md names the commit that still has them."""
