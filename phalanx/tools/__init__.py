"""Commands beside the loop: the launcher, report, bench, doctor, predict, generate."""
