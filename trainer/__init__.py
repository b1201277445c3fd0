"""Trainer role: drives microbatches through the stages; routing (IWRR), bans and retries. Holds no parameters."""
