"""The KV pool and the radix prefix cache."""
