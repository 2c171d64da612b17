"""What the tests share that is not a fixture: the prewarmed process server, the engine releases behind the suite's
network gate, batch and world builders, and the scripts some tests run in processes of their own."""
