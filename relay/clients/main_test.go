package clients

import (
	"testing"

	"stasis/stasistest"
)

// TestMain runs the test binary as stasis when asked (the supervisor that
// hosts the relay is this binary) and fails the run if a test left a
// process behind.
func TestMain(m *testing.M) { stasistest.Main(m) }
