"""The coordinator: membership and epochs, failure detection, the commit tracker and
recovery planning."""
