"""GRPO's prompts (task grpo): records -> prompts rendered with the chat template's generation prompt, with
the record's other fields kept for the reward functions; the built-in arithmetic task."""
