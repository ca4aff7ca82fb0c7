#include "tests/testing/engine_peer.h"

int main(int argc, char** argv) { return ferry::testing::RunEnginePeer(argc, argv); }
