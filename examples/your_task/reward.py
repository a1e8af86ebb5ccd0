"""Reward of the word-reversal task (docs/your-task.md): 1 for the exact reversed word, else 0."""


def reward(prompt, response, ground_truth, extra):
    return 1.0 if response.strip() == ground_truth else 0.0
