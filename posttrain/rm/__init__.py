"""Reward-model training (`posttrain rm`): Bradley-Terry loss on preference pairs."""
