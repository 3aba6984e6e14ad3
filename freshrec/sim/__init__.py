"""The simulator ``freshrec run`` drives: a seeded synthetic world of users and items with a
ground truth (``world``), its catalogue and background traffic (``traffic``, ``produce``,
``pacing``), and the closed loop of simulated users who ask for recommendations over Kafka and
click or convert as the world says (``closedloop``). It stands on the kernel and the wire
contracts alone, like any client of FreshRec."""
