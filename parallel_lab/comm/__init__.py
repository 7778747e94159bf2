"""Communication: collectives written by hand from send/recv, and the counter of what a step sends."""
