// Package crashcheck holds what must hold after a server killed at any
// step of the checkpoint protocol is recovered: the invariants the
// coordinator's crash tests (internal/control/coordinator, the server
// killed in process) and the kill matrix (internal/killmatrix, real
// processes SIGKILLed from outside) both check. It is for tests.
package crashcheck

import (
	"context"
	"errors"
	"fmt"

	"stasis/errdefs"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/relay"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// System is what the check looks at: a system opened on the state
// (after the recovery), as system.System has it.
type System struct {
	Coordinator *coordinator.Coordinator
	Provider    sandbox.Provider
	Store       store.Store
	Gateway     *relay.Gateway
	// Node, on a node of a cluster, is its name: only the episodes it
	// drives are its to check ("": every episode in the store).
	Node string
}

// Check checks, every time:
//
//   - no sandbox is left that no live episode runs in, and every live
//     episode's sandbox is there, with its supervisor answering and not
//     paused;
//   - each episode row agrees with what is live, and with the gateway
//     (attempt, sandbox, not revoked);
//   - every episode's ledger verifies and is not broken;
//   - no checkpoint is pending, and the journal is empty;
//   - every snapshot a committed checkpoint names exists, and of snaps
//     (every snapshot made, as far as the caller knows) those no
//     committed checkpoint names are gone.
//
// The error names the first thing that does not hold.
func Check(ctx context.Context, s System, snaps []string) error {
	c := s.Coordinator
	live := map[string]string{} // sandbox → episode
	for _, id := range c.LiveIDs() {
		e, _ := c.Live(id)
		live[e.SandboxID()] = id
		st, err := e.Status(ctx)
		if err != nil || st.State == "paused" {
			return fmt.Errorf("live episode %s: status %+v %v: left paused or unreachable", id, st, err)
		}
	}
	infos, err := s.Provider.List(ctx, nil)
	if err != nil {
		return err
	}
	listed := map[string]bool{}
	for _, info := range infos {
		listed[info.ID] = true
		if _, ok := live[info.ID]; !ok {
			return fmt.Errorf("sandbox %s (%v) is left, and no episode runs in it", info.ID, info.Labels)
		}
	}
	for sb, id := range live {
		if !listed[sb] {
			return fmt.Errorf("live episode %s's sandbox %s is gone", id, sb)
		}
	}
	rows, err := s.Store.ListEpisodes(ctx, "")
	if err != nil {
		return err
	}
	for _, row := range rows {
		if s.Node != "" && row.Node != s.Node {
			continue
		}
		e, ok := c.Live(row.ID)
		switch {
		case row.State == store.EpisodeRunning && (!ok || e.SandboxID() != row.Sandbox):
			return fmt.Errorf("episode %s is running in %s in the store, but not live there", row.ID, row.Sandbox)
		case ok && row.State != store.EpisodeRunning && row.State != store.EpisodeEnded:
			return fmt.Errorf("episode %s is live but %s in the store", row.ID, row.State)
		}
		if ok {
			st, err := s.Gateway.Episode(row.ID)
			if err != nil || st.Attempt != row.Attempt || st.Attempt != e.Attempt() || st.Sandbox != row.Sandbox || st.Revoked {
				return fmt.Errorf("live episode %s: the gateway says %+v (%v), the store attempt %d in %s", row.ID, st, err, row.Attempt, row.Sandbox)
			}
		}
		if rep, err := ledger.VerifyIn(s.Gateway.Ledgers(), row.ID); err != nil || !rep.OK || rep.Broken {
			return fmt.Errorf("ledger of %s: %+v %v", row.ID, rep, err)
		}
	}
	pending, err := s.Store.List(ctx, store.ListOptions{State: store.StatePending})
	if err != nil || len(pending) > 0 {
		return fmt.Errorf("checkpoints left pending: %+v %v", pending, err)
	}
	named, err := Named(ctx, s.Store)
	if err != nil {
		return err
	}
	for sn, ck := range named {
		if _, err := s.Provider.GetSnapshot(ctx, sn); err != nil {
			return fmt.Errorf("snapshot %s of committed checkpoint %s: %v", sn, ck, err)
		}
	}
	for _, sn := range snaps {
		if _, ok := named[sn]; ok {
			continue
		}
		if _, err := s.Provider.GetSnapshot(ctx, sn); !errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("snapshot %s is left, and no committed checkpoint names it (%v)", sn, err)
		}
	}
	if es, err := s.Store.Journal(ctx); err != nil || len(es) > 0 {
		return fmt.Errorf("the journal still holds %+v (%v)", es, err)
	}
	return nil
}

// Named maps each snapshot a committed checkpoint names to it.
func Named(ctx context.Context, st store.Store) (map[string]string, error) {
	named := map[string]string{}
	cks, err := st.List(ctx, store.ListOptions{State: store.StateCommitted})
	if err != nil {
		return nil, err
	}
	for _, ck := range cks {
		_, recs, err := st.Get(ctx, ck.ID)
		if err != nil {
			return nil, err
		}
		for _, rec := range recs {
			if rec.SnapshotID != "" {
				named[rec.SnapshotID] = ck.ID
			}
		}
	}
	return named, nil
}
