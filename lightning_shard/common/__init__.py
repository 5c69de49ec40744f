"""What both Lightning front ends (the ``Trainer`` strategy and the ``Fabric`` strategy) share: the strategy's
arguments and their validation, the precision dtypes, and the process-group set-up."""
