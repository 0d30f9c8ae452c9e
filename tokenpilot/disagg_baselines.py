"""Published prefill/decode deciders, as baselines for TokenPilot's (`tokenpilot.disagg`).

Both choose the decode instance first and then apply a fixed rule to the tokens that
instance would have to prefill itself (the prompt less its cached prefix). The instance
choices are TokenPilot's cost model in both, so a comparison measures the rule alone.
"""

from __future__ import annotations

from tokenpilot.disagg import DisaggConfig, RuleDisagg
from tokenpilot.router import TokenPilot


class DynamoConditional(RuleDisagg):
    """NVIDIA Dynamo's conditional disaggregation, policy `isl_bounding`.

    Source: ai-dynamo/dynamo, router docs "Conditional Disaggregation" (frontend flags
    `--router-conditional-disagg`, `--router-conditional-disagg-config`): the effective ISL is
    the prompt length less the selected *decode* worker's cached prefix overlap; the request
    prefills locally on that decode worker when the effective ISL is below
    `eff_isl_threshold` (default 2048) AND effective / raw ISL is below
    `eff_isl_ratio_threshold` (default 0.7); otherwise prefill worker -> decode worker.
    (The optional `decode_busy_threshold` guard is off by default there, and here.)
    """

    name = "dynamo_conditional"

    def __init__(self, router: TokenPilot, eff_isl_threshold: int = 2048, eff_isl_ratio_threshold: float = 0.7,
                 config: DisaggConfig | None = None) -> None:
        super().__init__(router, config)
        if not 0.0 <= eff_isl_ratio_threshold <= 1.0:
            raise ValueError("eff_isl_ratio_threshold must be in [0, 1]")
        self.eff_isl_threshold = eff_isl_threshold
        self.eff_isl_ratio_threshold = eff_isl_ratio_threshold

    def remote(self, uncached: int, prompt: int) -> bool:
        local = uncached < self.eff_isl_threshold and uncached / max(prompt, 1) < self.eff_isl_ratio_threshold
        return not local


class LlmDDecider(RuleDisagg):
    """llm-d's prefix-based P/D decider.

    Source: llm-d/llm-d-inference-scheduler, `PrefixDisaggregationDecider` (plugin
    `prefix-disaggregation-decider`, parameter `nonCachedTokens`): it inspects the chosen
    decode pod's prefix-cache match; when the non-cached part of the prompt is smaller than
    `nonCachedTokens` the decode pod runs it alone, otherwise a prefill pod is scheduled too
    (`nonCachedTokens: 0`, the default there, disables disaggregation; the deployment guides
    use values such as 512 or 1024). Default here: 512.
    """

    name = "llm_d_decider"

    def __init__(self, router: TokenPilot, non_cached_tokens: int = 512, config: DisaggConfig | None = None) -> None:
        super().__init__(router, config)
        if non_cached_tokens < 0:
            raise ValueError("non_cached_tokens must be >= 0")
        self.non_cached_tokens = non_cached_tokens

    def remote(self, uncached: int, prompt: int) -> bool:
        return self.non_cached_tokens > 0 and uncached >= self.non_cached_tokens
