"""Reward functions for tests/test_grpo.py, imported by path (grpo.reward_funcs=grpo_test_rewards:NAME) as a
user's own would be: deterministic and spread out on a tiny random model's completions."""


def length_reward(prompts, completions, completion_ids, **fields):
    """Rewards that differ within a group: the completion's length mod 3 (and None for every 7th length)."""
    return [None if len(ids) % 7 == 0 else float(len(ids) % 3) for ids in completion_ids]


def raises(prompts, completions, completion_ids, **fields):
    raise ValueError("no reward today")


def too_few(prompts, completions, completion_ids, **fields):
    return [0.0] * (len(completions) - 1)


def sees_fields(prompts, completions, completion_ids, answer, **fields):
    """Checks TRL's calling convention: a keyword list per record field, one value per completion."""
    assert len(answer) == len(completions) == len(prompts) == len(completion_ids)
    return [1.0 if isinstance(a, str) else 0.0 for a in answer]
