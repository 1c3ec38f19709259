"""`qlayer demo`: the headline features of qlayer, run end to end against real services."""
