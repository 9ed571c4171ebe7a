"""The serving hook: the `Rebalancer` (`rebalance`), the online policies that decide when and
how much to move (`policy`), their load estimate and change detector (`load_estimate`), and
the repairs they make of the placement in force (`repair`, `resplit_repair`)."""
