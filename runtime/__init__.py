"""What runs inside a rank: the decorator and Context, state capture and restore, the
snapshot copy engine, the process-group lifecycle, and the launchers."""
