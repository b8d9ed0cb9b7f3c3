"""The site wing's tests, in the rooms of ``p2pfl/sites/``; this folder (its
``daemon_helpers``) is on the import path of every room's tests."""
