"""Data generation: prompts written by the target (synthesize), the target's own answers and hidden states
(distill), the continuous batcher both run on, and the vLLM backend with the runner it starts in vLLM's
environment."""
