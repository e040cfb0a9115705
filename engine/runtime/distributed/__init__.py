"""One engine over several ranks (torch.distributed): the ranks and their collectives
(:mod:`.ranks`), the followers' loop (:mod:`.follower`), adapters sharded with FSDP2
(:mod:`.adapter_shards`), sampling and ``compute_logprobs`` spread over the ranks
(:mod:`.sample_spread`, :mod:`.logprob_spread`), and starting the ranks on one host or several
(:mod:`.launch`, :mod:`.nodes`)."""
