//! Black-box conformance tests: see tests/.
