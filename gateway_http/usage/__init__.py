"""Usage metering and budgets: what each chat turn cost, where it is stored, and who may spend
more this month (records, store, meter, tokens, budgets)."""
