"""GRPO post-training: tasks and tool environments, rewards, rollouts through the inference
path, group-relative advantages, the clipped surrogate with a KL penalty, routing replay."""
