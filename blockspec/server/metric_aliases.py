"""SGLang's names for the main Prometheus metrics (`sglang:num_running_reqs`, ...), served beside blockspec's own so
dashboards built for SGLang read a blockspec server unchanged: each alias is the same family renamed at scrape time."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# NOTE: blockspec family -> SGLang family (a counter's `_total` suffix follows its family)
SGLANG_NAMES = {
    "blockspec_prompt_tokens": "sglang:prompt_tokens",
    "blockspec_generation_tokens": "sglang:generation_tokens",
    "blockspec_num_running_reqs": "sglang:num_running_reqs",
    "blockspec_num_queue_reqs": "sglang:num_queue_reqs",
    "blockspec_token_usage": "sglang:token_usage",
    "blockspec_cache_hit_rate": "sglang:cache_hit_rate",
    "blockspec_spec_accept_length": "sglang:spec_accept_length",
    "blockspec_time_to_first_token_seconds": "sglang:time_to_first_token_seconds",
    "blockspec_time_per_output_token_seconds": "sglang:time_per_output_token_seconds",
    "blockspec_e2e_request_latency_seconds": "sglang:e2e_request_latency_seconds",
}


class SGLangAliases(Collector):
    """Collects `sources` and yields their SGLANG_NAMES families under SGLang's names."""

    def __init__(self, sources: list[Collector]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for family in source.collect():
                alias = SGLANG_NAMES.get(family.name)
                if alias is None:
                    continue
                renamed = Metric(alias, family.documentation, family.type, family.unit)
                renamed.samples = [sample._replace(name=alias + sample.name[len(family.name):])
                                   for sample in family.samples]
                yield renamed
