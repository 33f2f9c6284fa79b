"""Rollout engines beside slipstream's own sampler (:mod:`slipstream.rollouts`): vLLM (:mod:`.vllm_engine`)."""
