package relay

import (
	"testing"

	"stasis/internal/testsvc"
)

func TestMain(m *testing.M) { testsvc.Main(m) }
