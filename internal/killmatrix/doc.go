// Package killmatrix is the kill matrix (RELIABILITY.md): each party of
// an episode's checkpoint and restore (the harness, the supervisor with
// the relay it hosts, the gateway, `stasis serve`, a node of a cluster,
// QEMU and the keeper of a microVM) SIGKILLed from outside at each step
// of the protocol, stopped there by the server's step gate
// (STASIS_STEP_GATE), then recovered as documented and checked: no
// committed checkpoint lost, no ledger entry a harness received lost,
// nothing left behind, and the episode finished. The package has tests
// only.
package killmatrix
