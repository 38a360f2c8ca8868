package providers_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"stasis/errdefs"
	_ "stasis/internal/providers"
	"stasis/sandbox"
)

func TestEveryBuiltinProviderIsRegistered(t *testing.T) {
	if got, want := sandbox.Names(), []string{"e2b", "local", "microvm", "opensandbox", "sim"}; !slices.Equal(got, want) {
		t.Fatalf("Names() = %v, want %v", got, want)
	}
	for name, hosted := range map[string]bool{"local": false, "microvm": false, "e2b": true, "opensandbox": true, "sim": false} {
		d, err := sandbox.Lookup(name)
		if err != nil {
			t.Fatal(err)
		}
		if d.Hosted != hosted || sandbox.IsHosted(name) != hosted {
			t.Errorf("%s: hosted %v, want %v", name, d.Hosted, hosted)
		}
		// A host provider's sandboxes reach their own gateway socket; a
		// hosted one's the server's network address.
		if (d.GatewayURL == "") != hosted {
			t.Errorf("%s: gateway URL %q", name, d.GatewayURL)
		}
	}
}

func TestOpenLocalByName(t *testing.T) {
	p, err := sandbox.Open(context.Background(), "local", sandbox.Config{Home: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if p.Name() != "local" {
		t.Errorf("opened %s", p.Name())
	}
	if sbs, err := p.List(context.Background(), nil); err != nil || len(sbs) != 0 {
		t.Errorf("a new home lists %v (%v)", sbs, err)
	}
}

func TestUnknownProviderIsInvalid(t *testing.T) {
	_, err := sandbox.Open(context.Background(), "docker", sandbox.Config{})
	if !errors.Is(err, errdefs.ErrInvalid) || errdefs.ExitCode(err) != errdefs.ExitRefused {
		t.Fatalf("%v: want an invalid request", err)
	}
	for _, n := range sandbox.Names() {
		if !strings.Contains(err.Error(), n) {
			t.Errorf("%q does not name provider %s", err, n)
		}
	}
	if sandbox.IsHosted("docker") {
		t.Error("an unknown provider is not hosted")
	}
}
