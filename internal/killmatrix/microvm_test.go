package killmatrix_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/system"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/proc"
	"stasis/internal/providers/microvm"
	"stasis/internal/stasistest"
)

// MicroVMEnv, set to 1, runs the microVM cells (`make matrix`): each
// boots and saves guests under TCG, too slow for every `go test`.
const MicroVMEnv = "STASIS_KILL_MATRIX_MICROVM"

// vmParties are the parties of a microVM episode the host can kill: the
// guest's QEMU, the keeper that runs it (the supervisor and the harness
// are processes of the guest's kernel), and `stasis serve`, whose guests
// run on without it (their keepers are not its children) and which a
// restart finds again.
var vmParties = []string{"QEMU", "keeper", "stasis serve"}

var microvmProvider = providerCfg{
	name: microvm.Name,
	args: func(t *testing.T) []string {
		return []string{"--provider", microvm.Name, "--guest-binary", stasistest.StaticBinary(t)}
	},
	world: func(t *testing.T, c *system.Config) {
		c.Provider, c.GuestBinary = microvm.Name, stasistest.StaticBinary(t)
	},
	find: findVMParty,
}

// TestKillMatrixMicroVM kills the QEMU, the keeper and the server of a
// microVM episode at each step of a checkpoint and of a restore of a committed
// one, as TestKillMatrixLocal does for a local episode's parties.
func TestKillMatrixMicroVM(t *testing.T) {
	if os.Getenv(MicroVMEnv) != "1" {
		t.Skipf("the microVM cells run with %s=1 (make matrix): each boots guests under TCG", MicroVMEnv)
	}
	if os.Getenv(microvm.KernelEnv) == "" {
		t.Fatalf("%s is not set: run the tests with make (make deps-microvm unpacks the kernel)", microvm.KernelEnv)
	}
	start := time.Now()
	m := &matrix{}
	for _, party := range vmParties {
		for _, st := range steps {
			t.Run(party+"/"+strings.ReplaceAll(st.name, " ", "-"), func(t *testing.T) {
				cellStart := time.Now()
				m.add(runCell(t, microvmProvider, party, st))
				t.Logf("cell %s at %q: %.1fs", party, st.name, time.Since(cellStart).Seconds())
			})
		}
	}
	t.Logf("microVM matrix: %.0fs", time.Since(start).Seconds())
	if !t.Failed() && len(m.rows) == len(vmParties)*len(steps) {
		m.check(t, microvm.Name, vmParties)
	}
}

// findVMParty finds the host pid of the QEMU or the keeper of the one
// running microVM under state, from the provider's state (each
// sandbox's keeper.json names both processes' identities).
func findVMParty(state, party string, _ *supervisor.Status) (int, string) {
	ms, _ := filepath.Glob(filepath.Join(state, microvm.Name, "sandboxes", microvm.Name, "*", "keeper.json"))
	for _, m := range ms {
		b, err := os.ReadFile(m)
		if err != nil {
			continue
		}
		var k struct {
			Keeper proc.Identity `json:"keeper"`
			QEMU   proc.Identity `json:"qemu"`
		}
		if json.Unmarshal(b, &k) != nil || !proc.Alive(k.Keeper) {
			continue
		}
		id := k.Keeper
		if party == "QEMU" {
			id = k.QEMU
		}
		if !proc.Alive(id) {
			continue
		}
		return id.PID, fmt.Sprintf("the %s (host pid %d)", party, id.PID)
	}
	return 0, "no QEMU or keeper of the episode runs at this step (the retired episode's machine is gone; the fork's not yet made)"
}
