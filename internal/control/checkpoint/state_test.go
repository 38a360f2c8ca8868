package checkpoint

import "testing"

// TestLedgerCut: an in-place restore cuts the ledger at relay_position;
// a record from before positions were recorded cuts at relay_delivered.
func TestLedgerCut(t *testing.T) {
	p := func(v int64) *int64 { return &v }
	for _, c := range []struct {
		st   State
		want int64
	}{
		{State{RelayDelivered: p(4), RelayPosition: p(6)}, 6},
		{State{RelayDelivered: p(4)}, 4},
		{State{}, 0},
	} {
		if got := c.st.LedgerCut(); got != c.want {
			t.Errorf("%+v: cut %d, want %d", c.st, got, c.want)
		}
	}
}
