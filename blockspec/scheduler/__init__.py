"""The scheduler: admission, chunking, prefix-cache use, retraction, finishing, the step executor and its stats."""
