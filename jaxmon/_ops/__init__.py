"""Operations around the loop: the report thread, time spent, failures off the loop, the host-sync guard, FLOPs."""
