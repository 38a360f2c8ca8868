package local_test

import (
	"os"
	"strings"
	"testing"

	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/sandbox"
)

// TestReadOnlyBindOfAFile: a host file bound read-only into every sandbox
// (the stasis binary, at /stasis/bin/stasis) is there for the agent to
// run, and it cannot change it.
func TestReadOnlyBindOfAFile(t *testing.T) {
	t.Parallel()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env, ReadOnlyBinds: map[string]string{exe: "/stasis/bin/stasis"}})
	if err != nil {
		t.Fatal(err)
	}
	id := newSandbox(t, p)
	out, _ := run(t, p, id, sandbox.UserAgent, `[ -x /stasis/bin/stasis ] && echo runnable; echo x >> /stasis/bin/stasis 2>/dev/null && echo WRITABLE; ls -la /stasis /stasis/bin 2>&1`)
	if !strings.Contains(out, "runnable") || strings.Contains(out, "WRITABLE") {
		t.Errorf("the bound binary, as the agent:\n%s", out)
	}
}
