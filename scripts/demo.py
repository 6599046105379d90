"""`make demo`: the main job on the embedded default target (SmolLM2-135M-Instruct)."""

import sys

from draftheads.cli import main
from draftheads.prompts import load_prompts

prompt = load_prompts("bundled:eval", domains=["chat"])[0]
print(f"prompt ({prompt.id}): {prompt.turns[0]}\n")
sys.exit(main(["generate", "--prompt", prompt.turns[0], "--max-new-tokens", "128"]))
