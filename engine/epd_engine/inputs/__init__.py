"""A client request into engine input: chat messages and images into token ids, placeholders
and pixels (the checkpoint's processor), image loading within limits, remote images,
and the optional preprocessing worker processes."""
