"""The training loops, one file each: sft, grpo, ppo, importance_sampling, kto (and the code_rl recipe)."""
