"""Operations around the loop: the report thread, the watchdog, time spent, host-sync guard."""
