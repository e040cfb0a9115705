"""What a run costs: the forecast before it runs (the bound, :mod:`.forecast`; the expected figure from a
pilot, :mod:`.expected` and :mod:`.pilot`; both priced and kept, :mod:`.budget`; ``sess run --dry-run``,
:mod:`.dry_run`) and the spend as it runs (:mod:`.spend`, projecting the share of groups that train,
:mod:`.share`). The runner joins a run to it through the loop's hooks; nothing here runs a loop."""
