"""``cp``: context parallelism, the sequence sharded over cp ranks (a mesh dimension beside the
data-parallel ones, ``strategy.cp``). ``comm`` holds its communication (the ring's hops, Ulysses'
all-to-all, the head's pool), ``ring`` ring attention's autograd Function, ``causal`` the gpt's
causal, load-balanced ring, ``parallelize`` the vit's and the gpt's attention cores and token
slices, ``rules`` the parent's refusals and the planner's bytes."""
