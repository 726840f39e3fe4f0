"""What the engine measures itself against: the cost model (FLOPs and bytes of a forward), each step's roofline
bound, and the traffic a server records for replay. Torch-free."""
