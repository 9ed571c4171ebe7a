"""Seeing how plans do: backtests over history (`backtest`), closed-loop replay of a trace
with an online policy (`replay`), modeled step time (`simulate`), figures (`plot`)."""
